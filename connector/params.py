"""The ``kv_transfer_params`` that carry kvpath's per-request fields (no vLLM import).

D leg:  {"do_remote_prefill": true, "kvpath": {"transfer_id": T, "peer": "P-host:port", "peer_key": K,
        "tp_size": 2}}
        (``peer_key``, P's CURVE public key, only where D trusts several P keys; ``tp_size``,
        P's TP size, where it differs from D's: P rank r listens at port + r)
Both legs may carry ``"transfer_key": K``, a secret the client (the proxy) makes per
transfer: P then pushes only to a registration that carries the same K, so a peer that
learns a transfer id cannot receive its KV.
P leg:  {"do_remote_decode": true,  "kvpath": {"transfer_id": T, "lane": 2, "lease_id": "r7"}}
The proxy sends both legs at once; a plain client may instead send the P leg
first and pass P's returned ``kv_transfer_params`` to D unchanged.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from kvpath.connector.config import PUSH_GRANULARITIES, parse_host_port
from kvpath.connector.messages import MAX_TP_SIZE


class BadTransferParams(ValueError):
    pass


@dataclass(frozen=True)
class DecodeParams:
    transfer_id: str
    peer: str
    peer_key: str | None = None  # selects one of D's trusted P keys; can never add one
    transfer_key: str = ""  # the transfer's secret, sent to P with the registration
    tp_size: int = 0  # P's TP size (0: not given, taken to be D's)


@dataclass(frozen=True)
class PrefillParams:
    transfer_id: str
    lane: int | None
    lease_id: str | None = None
    transfer_key: str = ""  # when set, P pushes only to a registration carrying it
    push_granularity: str = ""  # this request's, over the connector's push_granularity knob ("": the knob's)


def _kvpath(params: Mapping[str, Any]) -> Mapping[str, Any]:
    kp = params.get("kvpath")
    if kp is None:
        return {}
    if not isinstance(kp, Mapping):
        raise BadTransferParams("kv_transfer_params.kvpath must be an object")
    return kp


def parse_decode(params: Mapping[str, Any] | None) -> DecodeParams | None:
    """None when the request is not a remote-prefill (D) request."""
    if not params or not params.get("do_remote_prefill"):
        return None
    kp = _kvpath(params)
    tid = kp.get("transfer_id")
    if not _valid_id(tid):
        raise BadTransferParams("kv_transfer_params.kvpath.transfer_id must be a non-empty UTF-8 string without NUL of at most 256 "
                                "characters")
    peer = kp.get("peer")
    try:
        parse_host_port(peer, "kv_transfer_params.kvpath.peer")
    except ValueError as e:
        raise BadTransferParams(str(e)) from None
    key = kp.get("peer_key")
    if key is not None and not (isinstance(key, str) and len(key) == 40 and key.isascii()):
        raise BadTransferParams("kv_transfer_params.kvpath.peer_key must be a 40-character z85 CURVE public key")
    tp = kp.get("tp_size", 0)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 0 <= tp <= MAX_TP_SIZE:
        raise BadTransferParams(f"kv_transfer_params.kvpath.tp_size must be an integer in [1, {MAX_TP_SIZE}]")
    return DecodeParams(tid, peer, key or None, _transfer_key(kp), tp)


def _transfer_key(kp: Mapping[str, Any]) -> str:
    k = kp.get("transfer_key")
    if k is None:
        return ""
    if not isinstance(k, str) or not 16 <= len(k) <= 128 or not k.isascii() or not k.isprintable():
        raise BadTransferParams("kv_transfer_params.kvpath.transfer_key must be 16-128 printable ASCII characters")
    return k


def _valid_id(tid: object) -> bool:
    """A non-empty string of at most 256 characters without NUL that encodes as UTF-8: a lone surrogate
    passes ``json.loads`` but can be neither logged to the trace nor sent to a peer."""
    if not isinstance(tid, str) or not tid or len(tid) > 256 or "\x00" in tid:
        return False  # (a NUL: P keys the flows of one transfer by "<id>\x00<D TP>.<D rank>")
    try:
        tid.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_prefill(params: Mapping[str, Any] | None, request_id: str) -> PrefillParams | None:
    """None when the request is not a remote-decode (P) request."""
    if not params or not params.get("do_remote_decode"):
        return None
    kp = _kvpath(params)
    tid = kp.get("transfer_id", request_id)
    if not _valid_id(tid):
        raise BadTransferParams("kv_transfer_params.kvpath.transfer_id must be a non-empty UTF-8 string without NUL of at most 256 "
                                "characters")
    lane = kp.get("lane")
    if lane is not None and (isinstance(lane, bool) or not isinstance(lane, int) or lane < 0):
        raise BadTransferParams("kv_transfer_params.kvpath.lane must be a non-negative integer")
    lease = kp.get("lease_id")
    if lease is not None and (not isinstance(lease, str) or len(lease) > 64 or not (lease == "" or _valid_id(lease))):
        raise BadTransferParams("kv_transfer_params.kvpath.lease_id must be a string")
    gran = kp.get("push_granularity", "")
    if gran not in ("", *PUSH_GRANULARITIES):
        raise BadTransferParams(f"kv_transfer_params.kvpath.push_granularity must be one of "
                                f"{', '.join(PUSH_GRANULARITIES)}, got {gran!r}")
    return PrefillParams(tid, lane, lease, _transfer_key(kp), gran)


def new_transfer_key() -> str:
    """A transfer's secret (both legs carry it)."""
    return secrets.token_urlsafe(24)


def decode_leg_params(transfer_id: str, peer: str, peer_key: str | None = None,
                      transfer_key: str = "", tp_size: int = 0) -> dict[str, Any]:
    kp: dict[str, Any] = {"transfer_id": transfer_id, "peer": peer}
    if tp_size:
        kp["tp_size"] = tp_size
    if peer_key:
        kp["peer_key"] = peer_key
    if transfer_key:
        kp["transfer_key"] = transfer_key
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvpath": kp}


def prefill_leg_params(transfer_id: str, lane: int | None = None, lease_id: str | None = None,
                       transfer_key: str = "", push_granularity: str = "") -> dict[str, Any]:
    kp: dict[str, Any] = {"transfer_id": transfer_id}
    if push_granularity:
        kp["push_granularity"] = push_granularity
    if transfer_key:
        kp["transfer_key"] = transfer_key
    if lane is not None:
        kp["lane"] = lane
    if lease_id:
        kp["lease_id"] = lease_id
    return {"do_remote_decode": True, "do_remote_prefill": False, "kvpath": kp}
