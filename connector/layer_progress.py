"""How far a layer-wise push's KV is computed: the engine thread reports layers, the
writer thread reads them (no I/O, no threads here).

vLLM calls ``save_kv_layer`` after each attention layer of a forward. For a request
whose prompt completes in that forward (``push_granularity: layer``), layer ``i``'s KV
is final once that call returns. The engine thread only appends ``(forward, layers)``
to a deque (no lock, no wake-up, no NIXL call); the writer, which polls every
millisecond while such a forward runs, applies them here to every push begun in that
forward. A prefill's flows (one per D rank it fans out to) share one
:class:`LayerProgress`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

# the latest forwards whose pushes are remembered; older ones have ended (their
# request finished or was aborted, which marks them final or aborted)
MAX_FORWARDS = 64


@dataclass
class LayerProgress:
    """One begun prefill's progress, shared by its flows: the tokens whose KV is final in
    every layer (whole blocks: earlier chunks), and in the forward that completes the
    prompt, from ``last_start`` on, the layers computed."""

    layers: int  # the model's KV layers (L)
    forward: int  # the worker's forward counter of the forward now feeding it
    done: int = 0  # layers that forward computed
    final: bool = False  # the request finished: its KV will not change (the commit may go)
    aborted: bool = False  # the request was aborted: no more WRITEs, the flow fails
    forward_end_at: float | None = None  # unix time the writer saw the last forward end
    finished_at: float | None = None  # unix time the request finished (the record's prefill_done_at)
    times: object = None  # vLLM's times of the P request (VllmTimes), from the final report
    blocks_released: bool = False  # every flow ended before the request did: free at its end
    tokens_final: int = 0  # tokens final in every layer (a multiple of P's block size)
    final_after: int | None = None  # an earlier chunk's forward: tokens_final once it ends
    last_start: int | None = None  # the prompt's last forward: its layers cover tokens from here
    gen: int = 0  # restarts (vLLM preempted the request): a flow of an older one pushes anew

    def feed(self, forward: int, final_before: int, final_after: int | None) -> None:
        """Forward ``forward`` computes the next part: an earlier chunk (``final_after``:
        the tokens final once it ends) or the prompt's last (None)."""
        self.forward, self.done, self.forward_end_at = forward, 0, None
        self.tokens_final = max(self.tokens_final, final_before)
        self.final_after = final_after
        self.last_start = self.tokens_final if final_after is None else None

    def restart(self) -> None:
        """vLLM preempted the request (its blocks are freed): everything is pushed anew."""
        self.gen += 1
        self.done, self.tokens_final, self.final_after, self.last_start = 0, 0, None, None

    def end(self, layers: int) -> None:
        """``layers`` of the current forward are computed (all: it ended)."""
        self.done = max(self.done, min(layers, self.layers))
        if self.forward_ended() and self.final_after is not None:
            self.tokens_final, self.final_after = max(self.tokens_final, self.final_after), None

    def forward_ended(self) -> bool:
        return self.done >= self.layers


@dataclass
class ForwardLayers:
    """The writer's view of the engine's forwards: which begun pushes each one feeds."""

    begun: dict[int, list[LayerProgress]] = field(default_factory=dict)  # forward -> its pushes
    reported: dict[int, int] = field(default_factory=dict)  # forward -> layers reported so far

    def begin(self, p: LayerProgress) -> None:
        """A push begins (or is fed by a new forward) with its forward's layers reported
        so far (a report can overtake the begin: it comes through a deque, the begin
        through the command queue)."""
        self.forget(p)
        self.begun.setdefault(p.forward, []).append(p)
        p.end(self.reported.get(p.forward, 0))
        self._bound()

    def forget(self, p: LayerProgress) -> None:
        """``p`` leaves the forward it was in (a new forward feeds it, or a restart)."""
        for fwd, ps in list(self.begun.items()):
            if any(q is p for q in ps):
                ps[:] = [q for q in ps if q is not p]
                if not ps:
                    del self.begun[fwd]

    def prune(self, now: float) -> None:
        """Forget forwards whose pushes all have every layer (or ended): the writer then
        stops polling every millisecond for them."""
        for fwd, ps in list(self.begun.items()):
            for p in ps:
                if (p.forward_ended() or p.final) and p.forward_end_at is None:
                    p.forward_end_at = now
            if all(p.forward_ended() or p.final or p.aborted for p in ps):
                del self.begun[fwd]

    def apply(self, events: Iterable[tuple[int, int]], now: float) -> bool:
        """Apply ``(forward, layers done)`` reports; True when any push moved."""
        moved = False
        for fwd, n in events:
            self.reported[fwd] = max(self.reported.get(fwd, 0), n)
            for p in self.begun.get(fwd, ()):
                if n > p.done and not p.aborted:
                    p.end(n)
                    moved = True
                    if p.forward_ended() and p.forward_end_at is None:
                        p.forward_end_at = now
        self.prune(now)
        self._bound()
        return moved

    def live(self) -> bool:
        """A forward with a begun push is running: the writer polls every millisecond."""
        return bool(self.begun)

    def _bound(self) -> None:
        while len(self.reported) > MAX_FORWARDS:
            del self.reported[min(self.reported)]
        while len(self.begun) > MAX_FORWARDS:
            del self.begun[min(self.begun)]


def drain(events: deque) -> list[tuple[int, int]]:
    """Everything the engine thread appended so far (popleft is atomic: no lock)."""
    out = []
    while True:
        try:
            out.append(events.popleft())
        except IndexError:
            return out
