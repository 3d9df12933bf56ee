"""Request bodies and headers of the P and D legs, per proxy mode.

- ``push`` (KVPathConnector): legs sent at once, matched by a transfer id; P's leg
  carries the reserved lane and its lease.
- ``pull`` (vLLM's NixlConnector): P leg first (``max_tokens`` 1), D leg with the
  ``kv_transfer_params`` P returned.
- ``inproc-push`` (vLLM's NixlPushConnector): legs sent at once with the same
  ``X-Request-Id``; D's params name P's engine and NIXL side channel.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpath.connector.config import parse_host_port
from kvpath.connector.params import decode_leg_params, new_transfer_key, prefill_leg_params
from kvpath.proxy.instances import Instance

MODES = ("push", "pull", "inproc-push")


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The P leg: same prompt, one token, no streaming."""
    b = copy.deepcopy(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b.pop("min_tokens", None)  # min_tokens > max_tokens (1) is a 400 from vLLM; D's leg keeps it
    b["kv_transfer_params"] = params
    return b


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    b = dict(body)
    b["kv_transfer_params"] = params
    return b


def push_legs(body: dict[str, Any], p: Instance, transfer_id: str, lane: int | None, lease_id: str | None):
    # a secret per transfer: P pushes only to the registration that carries it, so
    # whoever learns the transfer id (a log, another tenant) cannot receive the KV
    key = new_transfer_key()
    return (
        prefill_body(body, prefill_leg_params(transfer_id, lane, lease_id, transfer_key=key)),
        decode_body(body, decode_leg_params(transfer_id, p.kv_addr, transfer_key=key, tp_size=p.tp_size)),
    )


def pull_prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    return prefill_body(body, {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    })


def inproc_push_legs(body: dict[str, Any], p: Instance, request_id: str, endpoint: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both legs carry ``X-Request-Id: request_id``; vLLM names P's request after it
    (``cmpl-<id>-0`` for completions, ``chatcmpl-<id>`` for chat)."""
    host, port = parse_host_port(p.kv_addr, f"prefill instance {p.url} kv_addr")
    remote_rid = f"chatcmpl-{request_id}" if "chat" in endpoint else f"cmpl-{request_id}-0"
    return (
        prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False}),
        decode_body(body, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": p.engine_id,
            "remote_request_id": remote_rid, "remote_host": host, "remote_port": port, "tp_size": 1,
        }),
    )


def unsupported_field(body: dict[str, Any], mode: str) -> tuple[str, str] | None:
    """(field, message) when the request asks for what ``mode`` cannot serve, else None.

    With ``n`` > 1 (or ``best_of`` > 1) vLLM fans one request out to child requests
    that share its ``kv_transfer_params``: in the push modes each child would wait for
    the one push, so the request could never be served. Pull mode has no such limit."""
    if mode == "pull":
        return None
    for name in ("n", "best_of"):
        v = body.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1:
            return name, (f"{name}: {name}={v} is not supported in {mode} mode (the child requests of one vLLM request "
                          f"share its kv_transfer_params, so one KV push cannot serve them); "
                          f"send {v} separate requests with n=1 instead")
    return None


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Rough token count without a tokenizer (about 4 characters per token)."""
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int):
                return len(prompt)
            text = "".join(str(x) for x in prompt)
        else:
            text = str(prompt)
    return max(1, len(text) // 4)
