"""The path reservation service's wire, defined once for the service and every client.

- Its vocabularies: decision modes, load metrics, when a lane is reserved.
- Its routes, relative to the service's base URL (``http://HOST:8900``, or
  ``http://PROXY/reservation`` for the service inside the proxy).
- Its request and answer bodies (msgspec Structs; the JSON field names are the API
  that docs/reservation.md lists). The service decodes the requests with these types
  and encodes its answers with them; the clients do the reverse.
- The shapes of caller, as typed protocols that share one ``reserve`` signature, the
  fields of :class:`ReserveRequest` in its order: :class:`AsyncReserver` (the proxy's
  clients: in-process or over HTTP) and
  :class:`QueuedReserver` (P's connector: queued calls answered through a callback,
  so that its writer thread never waits on the service).

msgspec only (no pydantic or FastAPI): the connector imports this inside vLLM's
processes.
"""

from __future__ import annotations

import re
from typing import Annotated, Callable, Final, Literal, Protocol, Sequence, runtime_checkable

import msgspec
from msgspec import Meta

# ---- vocabularies ---------------------------------------------------------
MODES: Final = ("ecmp", "cc", "dc")  # hash-chosen lane, central decision, distributed decision
# joint placement (kvpath/placement.py): P, D and lane by predicted TTFT; D and lane by the
# network (P by load); P and D by load with the mode's lane
PLACEMENTS: Final = ("joint", "network", "load")
METRICS: Final = ("flows", "bytes")  # what cc/dc count on a link when they compare lanes
RESERVE_AT: Final = ("admission", "push")  # the proxy reserves at admission, or P's connector at push start

# ---- credentials ------------------------------------------------------------
# Every route but HEALTH_PATH and METRICS_PATH needs ``Authorization: Bearer TOKEN``:
# the service and its clients (the proxy, P's connectors) read TOKEN from a file or
# from this environment variable, never from a command line (docs/reservation.md).
TOKEN_ENV: Final = "KVPATH_RESERVATION_TOKEN"

# ---- routes ---------------------------------------------------------------
RESERVE_PATH: Final = "/v1/reserve"  # POST ReserveRequest -> ReserveAnswer (token)
RELEASE_PATH: Final = "/v1/release"  # POST ReleaseRequest -> ReleaseAnswer (idempotent; token)
RELEASES_PATH: Final = "/v1/releases"  # POST ReleasesRequest -> ReleasesAnswer (several at once; token)
LEASE_PATH: Final = "/v1/lease"  # POST LeaseUpdate -> LeaseAnswer (a flow's bytes and expected end; token)
PLACE_PATH: Final = "/v1/place"  # POST PlaceRequest -> PlaceAnswer (P, D and the lane at once; token)
LANES_PATH: Final = "/v1/lanes"  # POST LanesRequest -> LanesAnswer (token)
UNREGISTER_PATH: Final = "/v1/lanes/unregister"  # POST LanesRemoval -> LanesAnswer (token)
STATE_PATH: Final = "/v1/state"  # GET: active leases, loads per link, known lanes, counters (token)
DECISIONS_PATH: Final = "/v1/decisions"  # GET ?since=UNIX_S: the decision log (kvpath/reservation/replay.py; token)
HEALTH_PATH: Final = "/health"  # open
METRICS_PATH: Final = "/metrics"  # Prometheus; open

# ---- bodies ---------------------------------------------------------------
# Bounds a client cannot exceed: names and lists come from the network.
Host = Annotated[str, Meta(min_length=1, max_length=64)]
Port = Annotated[int, Meta(ge=0, le=65535)]
# One transfer's bytes: a whole 128k-token prompt of a large model is tens of GiB; a
# number past this is a caller's bug or an attempt to skew every later decision.
MAX_TRANSFER_BYTES: Final = 1 << 40  # 1 TiB


class LaneInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One lane's 5-tuple as its P worker learned it from the connection. Positional
    like a tuple: ``LaneInfo(lane, src_port, dst_port)``."""

    lane: Annotated[int, Meta(ge=0, le=1023)]
    src_port: Port
    dst_port: Port = 0
    src_ip: Annotated[str, Meta(max_length=64)] = ""
    dst_ip: Annotated[str, Meta(max_length=64)] = ""
    proto: Literal["tcp", "udp"] = "tcp"  # exact: a pattern's $ would also match "tcp\n"


# no "/" or ">": they separate the parts of a worker pair's name (WorkerPair.key)
ENGINE_ID_PATTERN: Final = r"\A[^/>]{1,128}\Z"
EngineId = Annotated[str, Meta(pattern=ENGINE_ID_PATTERN)]
Rank = Annotated[int, Meta(ge=0, le=1023)]


class WorkerPair(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The two ends of one KV flow: rank ``p_rank`` of P engine ``p_engine`` pushes to
    rank ``d_rank`` of D engine ``d_engine`` (engine ids: kv_transfer_config.engine_id).
    A transfer between two engines with TP=N is N such flows, one per rank pair.
    ``incarnation`` names the D worker's process (its NIXL agent): a registration
    replaces another incarnation's lanes, and a removal that names an incarnation
    removes only that one's, so a late removal never drops a restarted D's lanes."""

    p_engine: EngineId
    d_engine: EngineId
    p_rank: Rank = 0
    d_rank: Rank = 0
    incarnation: Annotated[str, Meta(max_length=256)] = ""

    @staticmethod
    def engine_id_problem(engine_id: str) -> str | None:
        """Why the service would refuse ``engine_id`` in a pair, or None."""
        if not re.match(ENGINE_ID_PATTERN, engine_id or ""):
            return f"engine id {engine_id!r} must have 1 to 128 characters and no '/' or '>'"
        return None

    def key(self) -> str:
        """The pair's name in the registry (without the incarnation)."""
        return f"{self.p_engine}/r{self.p_rank}>{self.d_engine}/r{self.d_rank}"


class FlowScope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which registered worker pairs carry a transfer: the pairs whose fields equal the
    given ones (an empty engine or a null rank matches any). The proxy names the two
    engines (every TP rank pair of theirs); P's connector names its own rank pair."""

    p_engine: Annotated[str, Meta(max_length=128)] = ""
    d_engine: Annotated[str, Meta(max_length=128)] = ""
    p_rank: Rank | None = None
    d_rank: Rank | None = None

    def is_empty(self) -> bool:
        return not self.p_engine and not self.d_engine and self.p_rank is None and self.d_rank is None

    def matches(self, pair: WorkerPair | None) -> bool:
        if self.is_empty():
            return True
        if pair is None:  # registered by a free-form name: only an unscoped request counts it
            return False
        return ((not self.p_engine or self.p_engine == pair.p_engine)
                and (not self.d_engine or self.d_engine == pair.d_engine)
                and (self.p_rank is None or self.p_rank == pair.p_rank)
                and (self.d_rank is None or self.d_rank == pair.d_rank))


class ReserveRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Ask for a lane for one transfer of ``bytes`` (0 to 1 TiB) from ``src_host`` to
    ``dst_host`` (fabric host names or IPs). ``lanes``: narrows the candidates to these,
    each a lane P's connector registered for the pair (in ``scope``): the service over
    HTTP refuses others (a 422 naming ``lanes``); unset: every registered lane;
    ``transfer_id``: names the decision; ``scope``: which registered worker pairs carry
    it (else every pair of the host pair, other engines' included)."""

    src_host: Host
    dst_host: Host
    bytes: Annotated[int, Meta(ge=0, le=MAX_TRANSFER_BYTES)]
    lanes: Annotated[list[LaneInfo], Meta(max_length=1024)] | None = None
    transfer_id: Annotated[str, Meta(max_length=256)] = ""
    scope: FlowScope | None = None


class ReserveAnswer(msgspec.Struct, kw_only=True):
    """The decision. ``fallback`` is "" when the service decided, else why not
    (``no_lanes``: no lane known for the pair; then ``lane`` is null). Every field
    has a default so that a client reads what it needs from any service version."""

    lease_id: str = ""
    transfer_id: str = ""
    src_host: str = ""
    dst_host: str = ""
    bytes: int = 0
    lane: int | None = None
    src_port: int | None = None
    path: list[str] | None = None  # node names, P host to D host
    spine: str | None = None  # the path's spine (null under one leaf)
    spines: list[str | None] = []  # the chosen lane's spine for every worker pair that carries the transfer
    expires_in_s: float | None = None
    mode: str = ""
    fallback: str = ""
    workers: list[str] = []  # the worker pairs that carry it, in the order of ``spines``


class ReleaseRequest(msgspec.Struct):
    lease_id: Annotated[str, Meta(min_length=1, max_length=64)]


class ReleaseAnswer(msgspec.Struct):
    lease_id: str
    released: bool  # False when it had already ended


MAX_RELEASES: Final = 1024  # lease ids in one ReleasesRequest


class ReleasesRequest(msgspec.Struct):
    """Several releases in one call (the proxy's HttpReserver gathers its own for a few
    milliseconds: a release only lowers the loads, so a late one decides nothing wrong)."""

    lease_ids: Annotated[list[Annotated[str, Meta(min_length=1, max_length=64)]],
                         Meta(min_length=1, max_length=MAX_RELEASES)]


class ReleasesAnswer(msgspec.Struct):
    released: int  # of the lease ids, those still live (each ended now)
    unknown: int  # those that had already ended (or never were)


# A flow longer than this is not expected: an update may hold its lease this far ahead.
MAX_EXPECTED_END_S: Final = 3600.0


class LeaseUpdate(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A live reservation's flow, better known now: its whole ``bytes`` (they replace
    the reserved ones on every link of its path) and, optionally, when it expects to end
    (``expected_end_s`` from now; the lease then lasts the service's lease time past
    that). A layer-wise push reserves at its first layer, before its prompt's last
    blocks exist, and holds its lane while P still computes."""

    lease_id: Annotated[str, Meta(min_length=1, max_length=64)]
    bytes: Annotated[int, Meta(ge=0, le=MAX_TRANSFER_BYTES)]
    expected_end_s: Annotated[float, Meta(ge=0, le=MAX_EXPECTED_END_S)] | None = None


class LeaseAnswer(msgspec.Struct, kw_only=True):
    lease_id: str = ""
    updated: bool = False  # False when the lease had already ended (released or expired)
    bytes: int = 0
    expires_in_s: float | None = None


class EngineInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One candidate engine as the caller sees it now: ``name`` is the caller's (the
    proxy's URL), ``host`` its fabric host, ``engine_id`` which registered worker pairs
    carry its flows ("" for any)."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]
    host: Host
    outstanding: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    queued_tokens: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    free_kv_tokens: Annotated[int, Meta(ge=0, le=1 << 40)] | None = None
    engine_id: Annotated[str, Meta(max_length=128)] = ""


class PlaceRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Choose P, D and the lane of one request together and reserve the lane
    (docs/placement.md)."""

    prefill: Annotated[list[EngineInfo], Meta(min_length=1, max_length=1024)]
    decode: Annotated[list[EngineInfo], Meta(min_length=1, max_length=1024)]
    prompt_tokens: Annotated[int, Meta(ge=1, le=100_000_000)]
    bytes: Annotated[int, Meta(ge=0, le=MAX_TRANSFER_BYTES)]
    transfer_id: Annotated[str, Meta(max_length=256)] = ""
    policy: Literal["joint", "network", "load"] = "joint"
    guard: Annotated[int, Meta(ge=0, le=1024)] = 4


class PlaceAnswer(msgspec.Struct, kw_only=True):
    """The chosen engines (by the request's names), the lane's reservation as
    :class:`ReserveAnswer` has it, and the prediction's parts (seconds)."""

    prefill: str = ""
    decode: str = ""
    lease_id: str = ""
    lane: int | None = None
    spine: str | None = None
    expires_in_s: float | None = None
    fallback: str = ""
    predicted: dict[str, float | int | None] = {}
    considered: int = 0


class LanesRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The lanes of one (P worker, D worker) pair of a host pair, so pairs never
    overwrite each other. ``pair`` names it by engines and ranks (what a scoped
    reservation selects on); ``worker`` is a free-form name for callers that have no
    engine ids (an unscoped reservation charges such pairs). One of the two, or both
    naming the same pair."""

    src_host: Host
    dst_host: Host
    worker: Annotated[str, Meta(max_length=512)] = ""
    lanes: Annotated[list[LaneInfo], Meta(min_length=1, max_length=1024)]
    pair: WorkerPair | None = None


class LanesRemoval(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A (P worker, D worker) pair whose lanes are gone (the D worker was forgotten, the
    P worker stopped): they are no longer candidates, nor charged. With ``pair`` and an
    incarnation, only that incarnation's lanes are removed."""

    src_host: Host
    dst_host: Host
    worker: Annotated[str, Meta(max_length=512)] = ""
    pair: WorkerPair | None = None


class LanesAnswer(msgspec.Struct):
    ok: bool
    lanes: int


class LaneGrant(msgspec.Struct, frozen=True):
    """What a client keeps of a :class:`ReserveAnswer`: the lane and the lease to end,
    or, with neither, why not (the service's ``fallback``, or the client's own reason:
    ``timeout``, ``unreachable``, ``http_<status>``, ``bad_answer``, ``rejected: ...``)."""

    lane: int | None = None
    lease_id: str | None = None
    spine: str | None = None
    fallback: str = ""

    @classmethod
    def of(cls, answer: ReserveAnswer) -> "LaneGrant":
        if answer.fallback:
            return cls(fallback=answer.fallback)
        return cls(answer.lane, answer.lease_id, answer.spine)


# Encoders/decoders are built once: msgspec caches nothing per call.
encode = msgspec.json.Encoder().encode
decode_answer = msgspec.json.Decoder(ReserveAnswer).decode
decode_lease = msgspec.json.Decoder(LeaseAnswer).decode
decode_place = msgspec.json.Decoder(PlaceAnswer).decode


# ---- the shapes of caller (the in-process service's is kvpath.reservation.SyncReserver) ----
@runtime_checkable
class AsyncReserver(Protocol):
    """The proxy's clients (``kvpath.reservation.clients``). ``reserve`` never
    raises for the service's faults: a grant without a lane says why. ``release`` may be
    sent later, with others (within milliseconds; ``close`` sends what is left): a
    release only lowers the loads."""

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                      transfer_id: str = "", scope: FlowScope | None = None) -> LaneGrant: ...

    async def release(self, lease_id: str) -> None: ...

    async def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> bool: ...

    async def place(self, req: "PlaceRequest") -> "PlaceAnswer | str": ...

    async def close(self) -> None: ...


# done(transfer_id, lane, lease_id): lane and lease_id are None when there is no decision
ReservedCallback = Callable[[str, int | None, str | None], None]


@runtime_checkable
class QueuedReserver(Protocol):
    """P's connector (``kvpath.reservation.notifier.ReservationNotifier``): every
    call only queues; ``reserve`` answers through ``done``, called from another thread
    (or at once, with no lane, when the queue is full)."""

    def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                transfer_id: str = "", scope: FlowScope | None = None, *, done: ReservedCallback) -> None: ...

    def release(self, lease_id: str) -> None: ...

    def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> None: ...

    def register_lanes(self, src_host: str, dst_host: str, lanes: Sequence[LaneInfo], worker: str = "",
                       pair: WorkerPair | None = None) -> None: ...

    def close(self) -> None: ...
