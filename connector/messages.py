"""Wire formats of the push protocol's control channel (msgspec/msgpack).

D -> P: ``Hello`` once per P peer (agent metadata, layout, compatibility), then
``Register`` (blocks ready to receive one request's KV) and ``Cancel``.
P -> D: ``Welcome`` (the handshake's answer), ``Ack`` (a registration's fate) and
``Pending`` (heartbeat: P is alive and still holds these registrations).
Data completion itself is a NIXL notification, ``NOTIF_PREFIX + transfer_id``,
so it is ordered after the WRITE's bytes.
"""

from __future__ import annotations

import hashlib

import msgspec

NOTIF_PREFIX = b"kvpath:done:"
# A completion notification that carries kv_verify's check (digest of the pushed bytes):
# "kvpath:done+<check>:<transfer id>". A D without kv_verify's code ignores it.
NOTIF_CHECK_PREFIX = b"kvpath:done+"
# Bounds a peer's timing fields must keep: a heartbeat asked every microsecond would
# spin P's writer, a post_by_s of inf would hold a registration forever.
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.05, 60.0
MAX_POST_BY_S = 3600.0
# 3: Ack.instance, Welcome.agents (a D that checks notifications by agent must not
# handshake with a P that does not name its agents). 4: Compat.kv_heads. 5: unequal TP
# sizes (Register.p_tp_size). A Hello of another version
# is answered with a refusing Welcome (its shape is the same since 3).
PROTOCOL_VERSION = 5
MAX_KV_HEADS = 1 << 16


class Region(msgspec.Struct, array_like=True, frozen=True):
    """One registered memory span holding ``num_blocks`` blocks."""

    base: int
    block_stride: int  # bytes between consecutive blocks
    block_len: int  # bytes of one block (== stride when the region is dense)


class BlockLayout(msgspec.Struct, frozen=True):
    regions: list[Region]
    num_blocks: int
    block_size: int  # tokens per block
    mem_type: str = "DRAM"
    device_id: int = 0

    def bytes_per_block(self) -> int:
        return sum(r.block_len for r in self.regions)

    def shape(self) -> str:
        """What must be equal on both sides for blocks to be copied as they are."""
        return f"{len(self.regions)}x[{','.join(str(r.block_len) for r in self.regions)}]"


class Compat(msgspec.Struct, frozen=True):
    """What P and D must agree on before any byte moves (checked once per peer)."""

    protocol: int = PROTOCOL_VERSION
    model: str = ""  # vLLM's served model name
    model_identity: str = ""  # path@revision, or the model_identity knob
    quantization: str = ""
    vllm_version: str = ""
    attention_backend: str = ""  # the layers' backends: their KV layout in memory
    dtype: str = ""  # KV cache dtype
    block_size: int = 0  # tokens per block
    kv_layout: str = ""  # BlockLayout.shape()
    layers: str = ""  # the KV layers' names and order, "count:digest"
    tp_size: int = 1
    tp_rank: int = 0  # D rank r pairs with P rank r
    kv_heads: int = 0  # the model's KV heads over all ranks (0: not known)

    def digest(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def mismatch(self, other: "Compat") -> tuple[str, str] | None:
        """(field, message) for the first field that differs, None when compatible."""
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return name, f"{name} differs: P has {mine!r}, D has {theirs!r}"
        return None


class Hello(msgspec.Struct, tag="hello", frozen=True):
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: BlockLayout
    compat: Compat
    instance: str  # random per D process
    heartbeat_s: float  # how often D wants P's Pending heartbeats
    # A small registered scratch buffer on D used to open lanes by a tiny WRITE.
    probe_addr: int = 0
    probe_len: int = 0
    # D's UCX listening ports: a lane's connection is the new one to one of these.
    listen_ports: list[int] = []
    # (address, port) of those listeners: P checks they answer before NIXL connects to
    # them (NIXL's connect blocks the caller while a firewall drops its packets)
    listen_addrs: list[tuple[str, int]] = []
    host: str = ""
    fabric_host: str = ""  # D's host in the fabric spec, for lane registration
    version: int = PROTOCOL_VERSION


class Register(msgspec.Struct, tag="register", frozen=True):
    transfer_id: str
    request_id: str  # D's own request id, for logs and the trace
    agent_name: str  # D's agent, known to P from the Hello
    block_ids: list[int]
    # P skips its first ``skip_blocks`` blocks (D already had them, e.g. a prefix hit).
    skip_blocks: int = 0
    sent_at: float = 0.0  # D's wall clock when sent; P subtracts the message's age
    post_by_s: float = 60.0  # P must not post a WRITE later than this after sent_at
    # The transfer's secret from D's kv_transfer_params (encrypted by CURVE on the wire):
    # P pushes only when it equals the one its own request carried.
    transfer_key: str = ""
    # The P TP size D chose its P ranks for (0: P's own, as at equal TP sizes): a P of
    # another size refuses the registration rather than push heads nobody expects.
    p_tp_size: int = 0


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    instance: str  # random per P process: a new value means P restarted
    ok: bool
    field: str = ""  # the incompatible field when refused
    detail: str = ""
    # P's lane connections to this D, (source ip, source port): sent again whenever a
    # lane reopens, before any WRITE on it. D watches them to tell that P is gone.
    lanes: list[tuple[str, int]] = []
    # ``lanes`` lists every lane connection of this P process to this D (each 5-tuple was
    # learned). False: D cannot prove P's bytes drained and falls back to its time bound.
    complete: bool = False
    # NIXL names of the agents P pushes from: D accepts a push's notification only
    # from one of these (of the P process its registration went to).
    agents: list[str] = []


class Ack(msgspec.Struct, tag="ack", frozen=True):
    transfer_id: str
    # accepted | posted | rejected | failed | cancelled | expired | aborted | ok | unknown_peer
    # ("posted": P is about to post the WRITE, so D progresses UCX fast from now on;
    # "ok"/"aborted": a Cancel's answer for a transfer that had already ended so)
    status: str
    detail: str = ""
    # A WRITE had been posted (it failed: its connection broke, or it completed): D
    # lets what its socket still holds drain before it reuses the blocks.
    posted: bool = False
    bytes: int = 0  # with "posted": the push's size, for how long D should spin
    # The P process that answers (its Welcome's instance). A "never posted" answer
    # proves nothing about a registration another process (a restarted P) held;
    # empty (unknown) never matches.
    instance: str = ""


class Pending(msgspec.Struct, tag="pending", frozen=True):
    transfer_ids: list[str]


ToPrefill = Hello | Register | Cancel
ToDecode = Welcome | Ack | Pending

_enc = msgspec.msgpack.Encoder()
_dec_to_p = msgspec.msgpack.Decoder(ToPrefill)
_dec_to_d = msgspec.msgpack.Decoder(ToDecode)


class MalformedMessage(ValueError):
    pass


class WrongVersion(MalformedMessage):
    """A Hello of another protocol version: answered with a refusal naming the
    versions, so D fails its requests at once instead of at its liveness clock."""


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> Hello | Register | Cancel:
    try:
        msg = _dec_to_p.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessage(str(e)) from None
    if isinstance(msg, Register):
        validate_register(msg)
    elif isinstance(msg, Hello):
        validate_hello(msg)
    elif not msg.transfer_id:
        raise MalformedMessage("cancel without transfer_id")
    elif "\x00" in msg.transfer_id:
        raise MalformedMessage("cancel of a transfer_id with a NUL character")
    return msg


def decode_to_decode(data: bytes) -> Welcome | Ack | Pending:
    try:
        return _dec_to_d.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessage(str(e)) from None


MAX_TP_SIZE = 1024  # far above any real TP size; the bound keeps a peer's value sane in logs and traces


def validate_hello(h: Hello) -> None:
    if h.version != PROTOCOL_VERSION:
        raise WrongVersion(f"protocol version {h.version}, expected {PROTOCOL_VERSION}")
    if not h.agent_name or not h.agent_metadata:
        raise MalformedMessage("hello without NIXL agent metadata")
    lay = h.layout
    if lay.num_blocks <= 0 or lay.block_size <= 0 or not lay.regions:
        raise MalformedMessage("hello with an empty block layout")
    for r in lay.regions:
        if r.base <= 0 or r.block_len <= 0 or r.block_stride < r.block_len:
            raise MalformedMessage(f"hello with a bad region {r}")
    if not MIN_HEARTBEAT_S <= h.heartbeat_s <= MAX_HEARTBEAT_S:  # also refuses nan
        raise MalformedMessage(f"hello with heartbeat_s {h.heartbeat_s} outside [{MIN_HEARTBEAT_S}, {MAX_HEARTBEAT_S}]")
    c = h.compat
    if not 1 <= c.tp_size <= MAX_TP_SIZE or not 0 <= c.tp_rank < c.tp_size:
        raise MalformedMessage(f"hello with tp_rank {c.tp_rank} of tp_size {c.tp_size} "
                               f"(tp_size must be in [1, {MAX_TP_SIZE}], tp_rank below it)")
    if not 0 <= c.kv_heads <= MAX_KV_HEADS:
        raise MalformedMessage(f"hello with kv_heads {c.kv_heads} outside [0, {MAX_KV_HEADS}]")


def validate_register(reg: Register) -> None:
    """Semantic checks a schema cannot express (block ids are checked against the
    layout the Hello gave, by the writer)."""
    if not reg.transfer_id:
        raise MalformedMessage("register without transfer_id")
    if "\x00" in reg.transfer_id:  # P keys the flows of one transfer by "<id>\x00<D rank>"
        raise MalformedMessage("transfer_id with a NUL character")
    if not reg.agent_name:
        raise MalformedMessage("register without agent_name")
    if reg.skip_blocks < 0:
        raise MalformedMessage("negative skip_blocks")
    if any(b < 0 for b in reg.block_ids):
        raise MalformedMessage("negative block id")
    if len(set(reg.block_ids)) != len(reg.block_ids):
        raise MalformedMessage("duplicate block ids")
    if not 0 <= reg.p_tp_size <= MAX_TP_SIZE:
        raise MalformedMessage(f"register with p_tp_size {reg.p_tp_size} outside [0, {MAX_TP_SIZE}]")
    if not 0 < reg.post_by_s <= MAX_POST_BY_S:  # also refuses inf and nan
        raise MalformedMessage(f"register with post_by_s {reg.post_by_s} outside (0, {MAX_POST_BY_S}]")


def split_notif(msg: bytes) -> tuple[str, bytes | None] | None:
    """(transfer id, kv_verify check or None) of a completion notification; None when
    the message is not one. With a check (``NOTIF_CHECK_PREFIX``, connector/kv_verify.py)
    the check comes first and holds no ``:``, the transfer id last."""
    if msg.startswith(NOTIF_PREFIX):
        return msg[len(NOTIF_PREFIX):].decode("utf-8", "replace"), None
    if msg.startswith(NOTIF_CHECK_PREFIX):
        check, sep, tid = msg[len(NOTIF_CHECK_PREFIX):].partition(b":")
        if sep:
            return tid.decode("utf-8", "replace"), check
    return None


def parse_notif(msg: bytes) -> str | None:
    parsed = split_notif(msg)
    return parsed[0] if parsed is not None else None


def make_notif(transfer_id: str, check: bytes = b"") -> bytes:
    """The completion notification; ``check`` (kv_verify's digest, no ``:`` in it) only
    for a push that kv_verify checks: without one it is the same bytes as ever."""
    if check:
        if b":" in check:
            raise ValueError("a notification's check must not hold ':'")
        return NOTIF_CHECK_PREFIX + check + b":" + transfer_id.encode()
    return NOTIF_PREFIX + transfer_id.encode()
