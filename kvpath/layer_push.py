"""When a request's KV can leave P, and when its push ends, at each push granularity.

A push of the whole request (``request``) starts when the prefill ends. A layer-wise push
(``layer``, in groups of ``group`` layers) sends each group's KV as soon as the group's
last layer is computed, behind the group before it on the same lane: the push then
overlaps the prefill, and with uniform layers it ends at ``max(Tc + Tt/L, Tt + Tc/L)``
instead of ``Tc + Tt`` (prefill time Tc, push time Tt, L layers).

One model for the parts that must agree on it (the emulated engines and the serving
simulation): layers take equal shares of the prefill's compute, and a push moves at one
rate. What the network makes of the groups' flows is the backends' business.
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULARITIES = ("request", "layer")
# in what order whole pushes waiting for a slot of P's uplink start: as they came, or the
# fewest bytes first (the connector's push_order, the serving simulation's UplinkGate)
PUSH_ORDERS = ("fifo", "srpt")


def variant_label(mode: str, granularity: str = "request") -> str:
    """A run's name among its variants: "cc", or "cc+layer" for a layer-wise run of mode cc."""
    return mode if granularity == "request" else f"{mode}+{granularity}"


class LayerPushError(ValueError):
    """A bad input, named by its field."""


def layer_done_times(start_s: float, end_s: float, layers: int, tail_s: float = 0.0) -> list[float]:
    """When each layer's KV is complete: the prefill from ``start_s`` to ``end_s``, its
    last ``tail_s`` after the last layer (sampling), the layers equal shares of the rest."""
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise LayerPushError(f"layers must be an integer >= 1, got {layers!r}")
    if not end_s >= start_s:
        raise LayerPushError(f"end_s ({end_s}) must not be before start_s ({start_s})")
    if not 0.0 <= tail_s <= end_s - start_s:
        raise LayerPushError(f"tail_s must be in [0, end_s - start_s], got {tail_s!r}")
    compute = end_s - start_s - tail_s
    return [start_s + compute * (i + 1) / layers for i in range(layers)]


def group_bytes(nbytes: int, layers: int, group: int) -> list[int]:
    """Bytes per group of ``group`` layers (the last group may be smaller); they add up to
    ``nbytes`` exactly, each layer holding an equal share (the remainder spread one byte
    at a time over the first layers)."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise LayerPushError(f"group must be an integer >= 1, got {group!r}")
    if nbytes < 0:
        raise LayerPushError(f"nbytes must be >= 0, got {nbytes!r}")
    per, extra = divmod(nbytes, layers)
    per_layer = [per + (1 if i < extra else 0) for i in range(layers)]
    return [sum(per_layer[i:i + group]) for i in range(0, layers, group)]


def piece_starts(prefill_start_s: float, prefill_end_s: float, layers: int, nbytes: int, granularity: str = "request",
                 group: int = 1) -> list[tuple[float, int]]:
    """When each piece of a push may leave P and its bytes: one piece at the prefill's end
    (``request``), or one per layer group when its last layer is computed (``layer``).
    What the network makes of them (queueing behind each other on one lane) is the
    caller's: :func:`plan_push` for one lane alone, a network backend for a fabric."""
    if granularity not in GRANULARITIES:
        raise LayerPushError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity == "request":
        return [(prefill_end_s, nbytes)]
    done = layer_done_times(prefill_start_s, prefill_end_s, layers)
    return [(done[min((k + 1) * group, layers) - 1], b) for k, b in enumerate(group_bytes(nbytes, layers, group))]


@dataclass(frozen=True)
class PushPlan:
    """A push's pieces on one lane: (start, end, bytes) each, in order."""

    pieces: tuple[tuple[float, float, int], ...]

    @property
    def start_s(self) -> float:
        return self.pieces[0][0]

    @property
    def end_s(self) -> float:
        return self.pieces[-1][1]

    def sent_before(self, t: float) -> int:
        """Bytes whose piece ended by ``t`` (the overlap with a prefill that ends at t)."""
        return sum(b for _, end, b in self.pieces if end <= t)


def plan_push(prefill_start_s: float, prefill_end_s: float, layers: int, nbytes: int, rate_bytes_s: float,
              granularity: str = "request", group: int = 1, tail_s: float = 0.0) -> PushPlan:
    """The push of a request's ``nbytes`` at ``rate_bytes_s`` (one lane, alone on it)."""
    if granularity not in GRANULARITIES:
        raise LayerPushError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if not rate_bytes_s > 0:
        raise LayerPushError(f"rate_bytes_s must be > 0, got {rate_bytes_s!r}")
    layer_done_times(prefill_start_s, prefill_end_s, layers, tail_s)  # checks the times
    if granularity == "request":
        return PushPlan(((prefill_end_s, prefill_end_s + nbytes / rate_bytes_s, nbytes),))
    pieces = []
    free_at = prefill_start_s  # when the lane has sent the group before
    compute_end = prefill_end_s - tail_s
    for ready, b in piece_starts(prefill_start_s, compute_end, layers, nbytes, granularity, group):
        start = max(ready, free_at)
        free_at = start + b / rate_bytes_s
        pieces.append((start, free_at, b))
    return PushPlan(tuple(pieces))
