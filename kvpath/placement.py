"""Where a request's bytes start and end: the cost model that placement policies share.

For a candidate (P, D, lane) of a request, :class:`CostModel` predicts its time to first
token as four parts, each from what the placer knows now:

- **wait**: P's queued prefill work (the prompt tokens admitted to P and not yet
  prefilled, in iterations of at most ``max_batch_tokens``), timed by the
  iteration-time model;
- **prefill**: this prompt's own prefill;
- **push**: the part of the KV push left after P's prefill ends. Each link of the lane's
  path (P's uplink, the spine links, D's downlink) carries this push beside the bytes
  already reserved on it, processor-sharing: a link with ``n`` reserved flows of ``C``
  bytes in all delays it by ``min(C, n x B)`` for a push of ``B`` bytes; the push takes
  as long as its slowest link. Layer-wise (``granularity`` layer), only what the
  overlap with the prefill leaves: ``max(Tt / G, Tt + Tc / G - Tc)`` for ``G`` pieces;
- **admit**: D's first decode iteration with its requests in flight and this one (and
  ``kv_full_penalty_s`` when D's free KV cannot hold the prompt).

Deterministic: the same inputs give the same numbers, so a decision log that keeps the
inputs replays every choice. The reservation service decides with it (``joint``
placement, kvpath/reservation/decisions.py); the serving simulation calls the same code.
Times are datacenter seconds times ``time_scale``; bytes and link rates in the units of
the fabric spec the placer reserves on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvpath.fabric import FabricSpec, Path
from kvpath.iteration_time import IterationTimeModel
from kvpath.reservation.wire import PLACEMENTS

# (flows, bytes) reserved on a link: LinkLoads.link, or a dc agent's DelayedView.link
Load = Callable[[tuple[str, str]], tuple[int, int]]

__all__ = ["CostModel", "Load", "EngineState", "Prediction", "PLACEMENTS", "PlacementError"]



class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class EngineState:
    """What the placer knows of one engine now. ``name`` identifies it to the caller
    (the proxy's URL, the simulation's index); ``host`` is its fabric host;
    ``engine_id`` scopes the lanes (kv_transfer_config.engine_id; "" for any)."""

    name: str
    host: str
    outstanding: int = 0  # requests in flight at it
    queued_tokens: int = 0  # P: prompt tokens admitted to it and not yet prefilled
    free_kv_tokens: int | None = None  # D: room in its KV cache, in tokens (None: not known)
    engine_id: str = ""


@dataclass(frozen=True)
class Prediction:
    p: int  # index into the P candidates
    d: int  # index into the D candidates
    lane: int | None  # lane id (None: no lane known for the pair)
    wait_s: float
    prefill_s: float
    push_s: float
    admit_s: float

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s + self.push_s + self.admit_s

    def to_dict(self) -> dict[str, float | int | None]:
        return {"p": self.p, "d": self.d, "lane": self.lane, "wait_s": round(self.wait_s, 9),
                "prefill_s": round(self.prefill_s, 9), "push_s": round(self.push_s, 9),
                "admit_s": round(self.admit_s, 9), "ttft_s": round(self.ttft_s, 9)}


@dataclass(frozen=True)
class CostModel:
    spec: FabricSpec
    itm: IterationTimeModel
    max_batch_tokens: int = 8192  # P's prefill tokens per iteration
    time_scale: float = 1.0  # compute times multiplied by this (the testbed's B/S)
    kv_full_penalty_s: float = 1.0  # added where D's free KV cannot hold the prompt
    granularity: str = "request"  # or "layer": the push overlaps the prefill
    layer_group: int = 4

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or not self.time_scale > 0 or self.kv_full_penalty_s < 0:
            raise PlacementError("max_batch_tokens must be >= 1, time_scale > 0, kv_full_penalty_s >= 0")
        if self.granularity not in ("request", "layer") or self.layer_group < 1:
            raise PlacementError(f"granularity must be request or layer and layer_group >= 1, got "
                                 f"{self.granularity!r}, {self.layer_group!r}")

    def to_dict(self) -> dict:
        """Everything but the fabric (the decision log's record of the model it decided by)."""
        return {"iteration_time": self.itm.to_dict(), "max_batch_tokens": self.max_batch_tokens,
                "time_scale": self.time_scale, "kv_full_penalty_s": self.kv_full_penalty_s,
                "granularity": self.granularity, "layer_group": self.layer_group}

    @classmethod
    def from_dict(cls, spec: FabricSpec, d: dict) -> "CostModel":
        """The model :meth:`to_dict` wrote, on ``spec``; a PlacementError names a bad field."""
        d = dict(d)
        known = {"iteration_time", "max_batch_tokens", "time_scale", "kv_full_penalty_s", "granularity",
                 "layer_group"}
        bad = sorted(set(d) - known)
        if bad:
            raise PlacementError(f"cost model: unknown field(s) {bad}; known: {sorted(known)}")
        try:
            itm = IterationTimeModel.from_dict(d.pop("iteration_time", {}))
            return cls(spec, itm, **d)
        except (ValueError, TypeError, KeyError) as e:
            raise PlacementError(f"cost model: {e}") from None

    # -- the parts ------------------------------------------------------------------
    def wait_s(self, p: EngineState) -> float:
        """P's queued prefill work before a new prompt's iteration."""
        q = max(int(p.queued_tokens), 0)
        if q == 0:
            return 0.0
        full, rest = divmod(q, self.max_batch_tokens)
        t = full * self.itm.one_prefill_time(self.max_batch_tokens) if full else 0.0
        return (t + (self.itm.one_prefill_time(rest) if rest else 0.0)) * self.time_scale

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.itm.one_prefill_time(max(int(prompt_tokens), 1)) * self.time_scale

    def admit_s(self, d: EngineState, prompt_tokens: int) -> float:
        """D's first decode iteration with its requests in flight and this one."""
        n = max(int(d.outstanding), 0) + 1
        t = self.itm.uniform_decode_time(n, max(int(prompt_tokens), 1)) * self.time_scale
        if d.free_kv_tokens is not None and d.free_kv_tokens < prompt_tokens:
            t += self.kv_full_penalty_s
        return t

    @staticmethod
    def link_s(rate_bps: float, nbytes: int, flows: int, reserved: int) -> float:
        """This push's time on one link of ``rate_bps`` that ``flows`` reserved flows of
        ``reserved`` bytes in all share (processor sharing)."""
        ahead = min(max(reserved, 0), max(flows, 0) * nbytes)
        return (nbytes + ahead) * 8 / rate_bps

    def link_shares(self, paths: tuple[Path, ...], nbytes: int) -> list[tuple[tuple[str, str], int, float]]:
        """(link, this flow's bytes on it, its rate in bit/s) for a flow over ``paths``, one
        per worker pair that carries it: the bytes split evenly among them (the remainder on
        the first, as the service charges them), so links the paths share (P's uplink, D's
        downlink) carry the sum. A path's first and last links are the hosts' own, at the
        host rate; the others at the spine rate."""
        host, spine = self.spec.host_link_gbps * 1e9, self.spec.spine_link_gbps * 1e9
        if len(paths) == 1:
            links = paths[0].links
            last = len(links) - 1
            return [(ln, nbytes, host if k in (0, last) else spine) for k, ln in enumerate(links)]
        n = len(paths)
        on: dict[tuple[str, str], tuple[int, float]] = {}
        for i, path in enumerate(paths):
            share = nbytes // n + (nbytes % n if i == 0 else 0)
            last = len(path.links) - 1
            for k, ln in enumerate(path.links):
                b, rate = on.get(ln, (0, host if k in (0, last) else spine))
                on[ln] = (b + share, rate)
        return [(ln, b, rate) for ln, (b, rate) in on.items()]

    def push_s(self, paths: tuple[Path, ...], nbytes: int, prefill_s: float, load: Load) -> float:
        """The push's time after P's prefill ends, over ``paths`` (see :meth:`link_shares`):
        as long as its slowest link takes."""
        tt = max((self.link_s(rate, b, *load(ln)) for ln, b, rate in self.link_shares(paths, nbytes)), default=0.0)
        return self.after_prefill(tt, prefill_s)

    def after_prefill(self, tt: float, prefill_s: float) -> float:
        """What is left after P's prefill ends of a push that takes ``tt`` on its path:
        all of it, or layer-wise what the overlap leaves."""
        if self.granularity == "request" or tt == 0.0:
            return tt
        g = max(1, math.ceil(self.itm.model.layers / self.layer_group))
        return max(tt / g, tt + prefill_s / g - prefill_s)

    def predict(self, p_i: int, p: EngineState, d_i: int, d: EngineState, lane: int | None, paths: tuple[Path, ...],
                prompt_tokens: int, nbytes: int, load: Load) -> Prediction:
        """One candidate's prediction: the lane ``lane`` over ``paths`` (one per worker pair)."""
        pre = self.prefill_s(prompt_tokens)
        push = self.push_s(paths, nbytes, pre, load)
        return Prediction(p_i, d_i, lane, self.wait_s(p), pre, push, self.admit_s(d, prompt_tokens))
