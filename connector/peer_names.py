"""One spelling for each P address, so that D opens one control link per P.

All of a D worker's control links present one routing id, and P's ROUTER hands an id
to the newest connection that presents it (``ROUTER_HANDOVER``, for D's reconnects).
Two links to one P under two spellings (``localhost:5600`` and ``127.0.0.1:5600``, a
host name and its address) took the id from each other: every later registration to
that P over either link was lost and timed out. So D keys its links, and the flows
that wait on them, by the address a spelling resolves to, and never by a name.

Literal addresses are normalised without a lookup. A host name is looked up on a thread
of its own (at most ``MAX_LOOKUPS`` at once), never on the receiver's or the engine's:
until the answer comes, ``canonical`` says so (None) and the receiver keeps the
registration unsent. An answer is kept ``TTL_S``; after that the address is still used
while a new lookup runs (a P keeps its link through a slow or failing resolver); an
address that is still among the answers is kept (a name with several), else one a link
already goes to. A name that does not resolve, with no earlier answer, fails its
requests (``Unresolvable``) for ``FAIL_TTL_S`` before it is looked up again. At most
``MAX_NAMES`` names with an address are kept, and ``MAX_UNRESOLVED`` without one apart: a
peer that sends a new name with each request can neither grow the cache nor push out
the names in use.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from kvpath.connector.config import parse_host_port

logger = logging.getLogger(__name__)

MAX_NAMES = 1024  # names with an address
MAX_UNRESOLVED = 64  # names without one yet (a lookup runs or failed), kept apart: made-up names leave first
MAX_LOOKUPS = 4  # lookups running at once; a name beyond them waits for a free one
TTL_S = 60.0  # a P moved to a new address is reached at it after about this long
FAIL_TTL_S = 5.0

Resolver = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's shape


class Unresolvable(ValueError):
    """A request names a P host that does not resolve."""


def literal(host: str) -> str | None:
    """``host`` as one spelling of an IP address (IPv6 in brackets), or None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return f"[{ip.compressed}]" if ip.version == 6 else str(ip)


@dataclass
class _Name:
    addr: str | None  # the address in use; None: none known yet
    valid_until: float  # ask again after this
    why: str = ""  # the last lookup's failure, when it failed
    looking: bool = False  # a lookup for it runs
    answers: list[str] = field(default_factory=list)  # the last lookup's addresses, not applied yet


class PeerNames:
    """``host:port`` -> the one spelling of its address. ``canonical`` is for one thread
    (the receiver's); lookups answer from theirs and call ``on_answer``."""

    def __init__(self, resolve: Resolver = socket.getaddrinfo, clock: Callable[[], float] = time.monotonic,
                 on_answer: Callable[[], None] = lambda: None, linked: Callable[[str], bool] = lambda addr: False):
        """``linked(addr)``: a control link to that address is open (receiver thread):
        of a name's addresses, one in use is kept."""
        self._resolve, self._clock, self.on_answer, self._linked = resolve, clock, on_answer, linked
        self._lock = threading.Lock()  # the cache, shared with the lookup threads
        self._names: OrderedDict[str, _Name] = OrderedDict()
        self._running = 0  # lookups under way

    def canonical(self, peer: str) -> str | None:
        """``peer`` (``host:port``) spelled by its address; None while its name is being
        looked up (ask again once ``on_answer`` was called). Raises Unresolvable."""
        host, port = parse_host_port(peer)
        addr = literal(host)
        if addr is None:
            addr = self._address_of(host.lower().rstrip("."))
        return None if addr is None else f"{addr}:{port}"

    def cached(self) -> int:
        """Names held."""
        with self._lock:
            return len(self._names)

    def _address_of(self, name: str) -> str | None:
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                entry = self._names[name] = _Name(None, 0.0)
                self._evict(name)
            self._names.move_to_end(name)
            if entry.answers:
                # new answers: the address in use stays while it is among them (a name with
                # several), else one a link already goes to (never two links to one P)
                if entry.addr not in entry.answers:
                    resolved_now = entry.addr is None
                    entry.addr = next((a for a in entry.answers if self._linked(a)), entry.answers[0])
                    if resolved_now:
                        self._evict(name)
                entry.answers = []
            if entry.valid_until <= self._clock() and not entry.looking and self._running < MAX_LOOKUPS:
                self._start_lookup(name, entry)
            if entry.addr is None and entry.why and not entry.looking:
                raise Unresolvable(f"P's host {name[:255]!r} does not resolve: {entry.why}")
            return entry.addr

    def _evict(self, asked: str) -> None:
        """At most MAX_UNRESOLVED names without an address and MAX_NAMES with one, the
        least recently asked-for leaving first; never ``asked``, the one just added or
        resolved. A peer's made-up names so never push out the names in use."""
        for resolved, bound in ((False, MAX_UNRESOLVED), (True, MAX_NAMES)):
            group = [n for n, e in self._names.items() if (e.addr is not None) == resolved]
            excess = len(group) - bound
            for victim in [n for n in group if n != asked][:max(0, excess)]:
                del self._names[victim]

    def _start_lookup(self, name: str, entry: _Name) -> None:
        entry.looking = True
        self._running += 1
        try:
            threading.Thread(target=self._lookup, args=(name, entry), name="kvpath-resolve", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: as a failed lookup, asked again later
            self._running -= 1
            entry.looking = False
            entry.valid_until, entry.why = self._clock() + FAIL_TTL_S, f"no thread for the lookup: {e}"

    def _lookup(self, name: str, entry: _Name) -> None:
        addrs: list[str] = []
        why = ""
        try:
            infos = self._resolve(name, None, type=socket.SOCK_STREAM)
            # IPv4 first: the control sockets do not enable IPv6, as libzmq's own lookup would not
            v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
            addrs = [a for a in (literal(str(x)) for x in v4 or [info[4][0] for info in infos]) if a]
            why = "" if addrs else "no address"
        except Exception as e:  # noqa: BLE001  any failure is the name's, never the thread's
            why = str(e)[:200] or type(e).__name__
        with self._lock:
            self._running -= 1
            entry.looking = False
            if addrs:
                entry.answers = addrs  # applied on the receiver thread, which knows the links
                entry.valid_until, entry.why = self._clock() + TTL_S, ""
            else:
                # an address known before is kept (a failing resolver must not move a live P)
                entry.valid_until, entry.why = self._clock() + FAIL_TTL_S, why
                logger.warning("P's host %r does not resolve (%s)%s", name[:255], why,
                               f": still using {entry.addr}" if entry.addr else "")
        self.on_answer()
