"""Who may talk on the control channel: libzmq CURVE keys, loaded from files.

The trust anchor is each engine's own configuration, never a request: P accepts
only the D keys in its ``control_trusted_keys`` directory (checked by a ZAP
handler, pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`), and D talks only
to P servers whose key is in its own. D's NIXL agent metadata (which grants access
to its KV memory) leaves D only over a CURVE connection to such a key.

Key files are pyzmq's certificate files: ``NAME.key`` (public) and
``NAME.key_secret`` (public and secret), made by ``kvpath connector keys DIR``.

Every message P receives carries the sender's public key (the ZAP ``User-Id``),
and D's routing id starts with a digest of its key (:func:`routing_id`), so P can
bind each routing id, agent and transfer to the key that authenticated it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvpath.connector.config import ConfigError

logger = logging.getLogger(__name__)

# The largest control message either side accepts (libzmq drops the connection of a
# peer that sends more). A Hello carries NIXL metadata and the block layout, a
# Register one int per block: 4 MiB holds ~500k block ids.
MAX_MESSAGE_BYTES = 4 << 20
_DIGEST_BYTES = 16
_NONCE_BYTES = 8
_ROUTING_MARK = b"k"  # a routing id must not start with a zero byte (libzmq's own ids do)
_HEAD = 1 + _DIGEST_BYTES + _NONCE_BYTES
# ZMTP heartbeats: a half-open control connection (a peer gone without FIN) is dropped in
# seconds (P's ROUTER hands a reconnecting D's id to the new connection at once).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
HANDSHAKE_IVL_MS = 5000  # an unauthenticated connection holds a descriptor this long at most
_ZAP_DOMAIN = "kvpath"


@dataclass(frozen=True)
class ControlKeys:
    """This engine's key pair and the peer keys it trusts (z85 bytes)."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def load(cls, secret_path: str, trusted_dir: str) -> "ControlKeys":
        try:
            public, secret = zmq.auth.load_certificate(secret_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config.control_key: cannot read {secret_path!r}: {e}") from None
        if not secret:
            raise ConfigError(f"kv_connector_extra_config.control_key: {secret_path!r} holds no secret key "
                            "(give the NAME.key_secret file)")
        if not os.path.isdir(trusted_dir):
            raise ConfigError(f"kv_connector_extra_config.control_trusted_keys: {trusted_dir!r} is not a directory")
        try:
            trusted = frozenset(zmq.auth.load_certificates(trusted_dir))
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config.control_trusted_keys: {trusted_dir!r}: {e}") from None
        if not trusted:
            raise ConfigError(f"kv_connector_extra_config.control_trusted_keys: no *.key file in {trusted_dir!r}")
        return cls(public, secret, trusted)


def key_digest(public_z85: bytes) -> bytes:
    return hashlib.sha256(public_z85).digest()[:_DIGEST_BYTES]


def routing_id(public_z85: bytes | None, agent_name: str) -> bytes:
    """D's routing id on the control channel: fixed for the socket (a reconnect keeps it,
    so P's replies reach D after a broken connection), bound to D's key, and with a
    random part that other peers cannot guess (it travels inside the CURVE handshake): P
    hands the id to the newest connection that presents it, so that part is what keeps
    another peer from taking this one's answers."""
    head = _ROUTING_MARK + (key_digest(public_z85) if public_z85 else b"\0" * _DIGEST_BYTES)
    return (head + os.urandom(_NONCE_BYTES) + agent_name.encode())[:255]


def routing_id_matches(ident: bytes, user_key: bytes | None) -> bool:
    """Was ``ident`` made (by :func:`routing_id`) for the key that authenticated it?"""
    if ident[:1] != _ROUTING_MARK:
        return False
    if user_key is None:  # plaintext on loopback: no key to bind to
        return True
    return ident[1 : 1 + _DIGEST_BYTES] == key_digest(user_key)


def names_agent(ident: bytes, agent_name: str) -> bool:
    """Is ``ident`` the routing id of ``agent_name`` (a message about an agent must come
    from that agent's own connection)?"""
    return ident[_HEAD:] == agent_name.encode()[: 255 - _HEAD]


def make_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory`` (made 0700; the
    secret file 0600). Refuses to overwrite an existing pair."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    pub, sec = d / f"{name}.key", d / f"{name}.key_secret"
    if pub.exists() or sec.exists():
        raise FileExistsError(f"{pub} or {sec} exists: remove it first or choose another name")
    pub_s, sec_s = zmq.auth.create_certificates(str(d), name)
    os.chmod(sec_s, 0o600)
    return Path(pub_s), Path(sec_s)


def make_trust_dir(directory: str | Path, public_files: list[Path]) -> Path:
    """A directory holding copies of the given public key files (a trust set)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for f in public_files:
        (d / f.name).write_bytes(f.read_bytes())
    return d


def _pd_layout(d: Path) -> dict[str, dict[str, str]]:
    """Where :func:`pd_keys` puts each side's knobs (one place for the file names)."""
    return {short: {"control_key": str(d / f"{name}.key_secret"), "control_trusted_keys": str(d / f"trusted-by-{name}")}
            for short, name in (("p", "prefill"), ("d", "decode"))}


def pd_keys(directory: str | Path) -> dict[str, dict[str, str]]:
    """One key pair for the prefill pool and one for the decode pool under ``directory``,
    each side trusting the other's: the connector knobs per role, ``{"p": {...}, "d": {...}}``.
    What the testbed, the demo and the tests use (each run makes its own)."""
    d = Path(directory)
    p_pub, _ = make_keys(d, "prefill")
    d_pub, _ = make_keys(d, "decode")
    make_trust_dir(d / "trusted-by-prefill", [d_pub])
    make_trust_dir(d / "trusted-by-decode", [p_pub])
    return _pd_layout(d)


def pd_key_knobs(directory: str | Path, side: str) -> dict[str, str]:
    """The knobs of ``side`` ("p"/"d"; vLLM's kv_producer/kv_consumer and the testbed's
    prefill/decode are accepted) from :func:`pd_keys` in ``directory``, made there on first use."""
    d = Path(directory)
    short = {"kv_producer": "p", "prefill": "p", "kv_consumer": "d", "decode": "d"}.get(side, side)
    if short not in ("p", "d"):
        raise ValueError(f"side must be p or d, got {side!r}")
    if not (d / "prefill.key_secret").exists():
        pd_keys(d)
    return _pd_layout(d)[short]


def shared_keys(directory: str | Path) -> dict[str, str]:
    """One key pair that trusts itself: the same knobs serve P and D (a pre-shared
    cluster key). For tests and tools that give both sides one config."""
    d = Path(directory)
    pub, sec = make_keys(d, "cluster")
    trust = make_trust_dir(d / "trusted", [pub])
    return {"control_key": str(sec), "control_trusted_keys": str(trust)}


class _TrustedKeys:
    """ZAP credentials callback over a fixed key set (runs on the authenticator's thread)."""

    def __init__(self, trusted: frozenset[bytes], on_denied: Any = None):
        self.trusted = trusted
        self.on_denied = on_denied
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.trusted
        if not ok:
            self.denied += 1
            if self.denied <= 10 or self.denied % 1000 == 0:  # a refused peer must not flood the log
                logger.warning("control channel: refused a peer with an untrusted key %s (%d refused so far)",
                               key.decode(errors="replace"), self.denied)
            if self.on_denied is not None:
                self.on_denied()
        return ok


class CurveServer:
    """P's side: a context of its own with a ZAP handler checking D keys."""

    def __init__(self, keys: ControlKeys, on_denied: Any = None):
        self.keys = keys
        self.ctx = zmq.Context()
        try:
            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(__name__ + ".zap"))
            self.auth.start()
            self.auth.configure_curve_callback(_ZAP_DOMAIN, _TrustedKeys(keys.trusted, on_denied))
        except Exception:
            self.ctx.destroy(0)
            raise

    def socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.curve_secretkey = self.keys.secret
        s.curve_publickey = self.keys.public
        s.curve_server = True
        s.zap_domain = _ZAP_DOMAIN.encode()
        s.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never accept all
        return s

    def close(self) -> None:
        try:
            self.auth.stop()
        finally:
            self.ctx.destroy(0)  # closes any socket still open: shutdown never waits on a peer


def secure_client(sock: zmq.Socket, keys: ControlKeys, server_key: bytes) -> None:
    """D's side: talk to a P whose public key is ``server_key`` (one of ``keys.trusted``)."""
    if server_key not in keys.trusted:
        raise ConfigError("P's key is not in control_trusted_keys")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key


def harden(sock: zmq.Socket, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Limits every control socket gets: the largest frame (libzmq closes the connection
    of a peer that sends more), heartbeats and a handshake deadline."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
