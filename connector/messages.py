"""Wire formats of the push protocol's control channel (msgspec/msgpack).

D -> P: ``Register`` (blocks ready to receive a request's KV) and ``Cancel``.
P -> D: ``Ack`` (accepted, rejected, failed, cancelled, expired).
Data completion itself is a NIXL notification, ``NOTIF_PREFIX + transfer_id``,
so it is ordered after the WRITE's bytes.
"""

from __future__ import annotations

import msgspec

NOTIF_PREFIX = b"kvpath:done:"
PROTOCOL_VERSION = 1


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


class Register(msgspec.Struct, tag="register", frozen=True):
    transfer_id: str
    request_id: str  # D's own request id, for logs and the trace
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: BlockLayout
    block_ids: list[int]
    # P skips its first ``skip_blocks`` blocks (D already had them, e.g. a prefix hit).
    skip_blocks: int = 0
    # A small registered scratch buffer on D used to open lanes by a tiny WRITE.
    probe_addr: int = 0
    probe_len: int = 0
    host: str = ""
    fabric_host: str = ""  # D's host in the fabric spec, for lane registration
    version: int = PROTOCOL_VERSION


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Ack(msgspec.Struct, tag="ack", frozen=True):
    transfer_id: str
    status: str  # accepted | duplicate | rejected | failed | cancelled | expired
    detail: str = ""


ToPrefill = Register | Cancel

_enc = msgspec.msgpack.Encoder()
_dec_to_p = msgspec.msgpack.Decoder(ToPrefill)
_dec_to_d = msgspec.msgpack.Decoder(Ack)


class MalformedMessage(ValueError):
    pass


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> Register | Cancel:
    try:
        msg = _dec_to_p.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessage(str(e)) from None
    if isinstance(msg, Register):
        validate_register(msg)
    elif not msg.transfer_id:
        raise MalformedMessage("cancel without transfer_id")
    return msg


def decode_ack(data: bytes) -> Ack:
    try:
        return _dec_to_d.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessage(str(e)) from None


def validate_register(reg: Register) -> None:
    """Semantic checks a schema cannot express."""
    if reg.version != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {reg.version}, expected {PROTOCOL_VERSION}")
    if not reg.transfer_id:
        raise MalformedMessage("register without transfer_id")
    if not reg.agent_name or not reg.agent_metadata:
        raise MalformedMessage("register without NIXL agent metadata")
    lay = reg.layout
    if lay.num_blocks <= 0 or lay.block_size <= 0 or not lay.regions:
        raise MalformedMessage("register with an empty block layout")
    for r in lay.regions:
        if r.base <= 0 or r.block_len <= 0 or r.block_stride < r.block_len:
            raise MalformedMessage(f"register with a bad region {r}")
    if reg.skip_blocks < 0:
        raise MalformedMessage("negative skip_blocks")
    for b in reg.block_ids:
        if not 0 <= b < lay.num_blocks:
            raise MalformedMessage(f"block id {b} outside [0, {lay.num_blocks})")
    if len(set(reg.block_ids)) != len(reg.block_ids):
        raise MalformedMessage("duplicate block ids")


def parse_notif(msg: bytes) -> str | None:
    if msg.startswith(NOTIF_PREFIX):
        return msg[len(NOTIF_PREFIX):].decode("utf-8", "replace")
    return None


def make_notif(transfer_id: str) -> bytes:
    return NOTIF_PREFIX + transfer_id.encode()
