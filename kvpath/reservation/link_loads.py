"""Reserved load per directed link, as the reservation service counts it: flows and
bytes per link (:class:`LinkLoads`), and for ``dc`` mode what one P host's agent
believes, the truth minus the other hosts' changes it has not heard of yet
(:class:`Unheard`, :class:`DelayedView`). Integer sums, so loads return exactly to zero.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from kvpath.fabric import Path

__all__ = ["Link", "LinkLoads", "LoadEvent", "Unheard", "DelayedView", "core_links"]

Link = tuple[str, str]


def core_links(paths: tuple[Path, ...]) -> tuple[Link, ...]:
    """The switch-to-switch links of a flow's paths (one per worker pair), each once."""
    if len(paths) == 1:
        return paths[0].core_links
    return tuple(dict.fromkeys(link for p in paths for link in p.core_links))


class LinkLoads:
    """Reserved flows and bytes per directed link."""

    def __init__(self) -> None:
        self.flows: dict[Link, int] = defaultdict(int)
        self.bytes: dict[Link, int] = defaultdict(int)

    def add(self, links: tuple[Link, ...], nbytes: int, sign: int) -> None:
        flows, nb, db = self.flows, self.bytes, sign * nbytes
        for ln in links:
            f, b = flows.get(ln, 0) + sign, nb.get(ln, 0) + db
            if f == 0 and b == 0:  # (sums of mixed dc events can be 0 flows, not 0 bytes)
                flows.pop(ln, None)
                nb.pop(ln, None)
            else:
                flows[ln] = f
                nb[ln] = b

    def cost(self, links: tuple[Link, ...]) -> tuple[int, int, int]:
        """(flows on the busiest link, bytes summed over the links, bytes on the link
        with the most)."""
        flows, nbytes = self.flows, self.bytes
        worst = total = worst_b = 0
        for ln in links:
            f = flows.get(ln, 0)
            if f > worst:
                worst = f
            b = nbytes.get(ln, 0)
            total += b
            worst_b = max(worst_b, b)
        return worst, total, worst_b

    def link(self, ln: Link) -> tuple[int, int]:
        """(reserved flows, reserved bytes) on one link."""
        return self.flows.get(ln, 0), self.bytes.get(ln, 0)

    def total_flows(self) -> int:
        return sum(self.flows.values())


@dataclass
class LoadEvent:
    time: float
    origin: str
    links: tuple[Link, ...]
    nbytes: int
    sign: int


class Unheard:
    """``dc`` mode: the changes younger than the broadcast delay, summed per link
    over all hosts and per origin host, kept up to date as events come and age out.

    An agent's view is the truth minus the changes of *other* hosts it has not heard
    of yet, so a decision costs a few dict lookups however many events are in flight."""

    def __init__(self) -> None:
        self.events: deque[LoadEvent] = deque()
        self.all = LinkLoads()
        self.by_host: dict[str, LinkLoads] = defaultdict(LinkLoads)

    def push(self, e: LoadEvent) -> None:
        self.events.append(e)
        self.all.add(e.links, e.nbytes, e.sign)
        self.by_host[e.origin].add(e.links, e.nbytes, e.sign)

    def age_out(self, before: float) -> None:
        ev = self.events
        while ev and ev[0].time <= before:
            e = ev.popleft()  # heard by everyone by now
            self.all.add(e.links, e.nbytes, -e.sign)
            mine = self.by_host[e.origin]
            mine.add(e.links, e.nbytes, -e.sign)
            if not mine.flows:  # flows and bytes are dropped together
                del self.by_host[e.origin]


class DelayedView:
    """What one P host's agent believes: true loads minus others' unheard changes."""

    def __init__(self, truth: LinkLoads, unheard: Unheard, host: str):
        self.truth, self.all, self.mine = truth, unheard.all, unheard.by_host.get(host)

    def link(self, ln: Link) -> tuple[int, int]:
        """(flows, bytes) this agent believes are reserved on one link."""
        mf, mb = (self.mine.flows, self.mine.bytes) if self.mine else ({}, {})
        return (self.truth.flows.get(ln, 0) - self.all.flows.get(ln, 0) + mf.get(ln, 0),
                self.truth.bytes.get(ln, 0) - self.all.bytes.get(ln, 0) + mb.get(ln, 0))

    def cost(self, links: tuple[Link, ...]) -> tuple[int, int, int]:
        tf, tb, af, ab = self.truth.flows, self.truth.bytes, self.all.flows, self.all.bytes
        mf = self.mine.flows if self.mine else {}
        mb = self.mine.bytes if self.mine else {}
        worst = total = worst_b = 0
        for ln in links:
            f = tf.get(ln, 0) - af.get(ln, 0) + mf.get(ln, 0)
            if f > worst:
                worst = f
            b = tb.get(ln, 0) - ab.get(ln, 0) + mb.get(ln, 0)
            total += b
            worst_b = max(worst_b, b)
        return worst, total, worst_b
