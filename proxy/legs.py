"""Request bodies and headers of the P and D legs, per proxy mode.

- ``push`` (KVPathConnector): legs sent at once, matched by a transfer id; P's leg
  carries the reserved lane and its lease.
- ``pull`` (vLLM's NixlConnector): P leg first (``max_tokens`` 1), D leg with the
  ``kv_transfer_params`` P returned.
- ``inproc-push`` (vLLM's NixlPushConnector): legs sent at once with the same
  ``X-Request-Id``; D's params name P's engine and NIXL side channel.
"""

from __future__ import annotations

from typing import Any

from kvpath.connector.config import parse_host_port
from kvpath.connector.params import decode_leg_params, new_transfer_key, prefill_leg_params
from kvpath.proxy.instances import Instance

MODES = ("push", "pull", "inproc-push")
MAX_P_TP = 1024  # as the proxy's own tp= field takes


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The P leg: same prompt, one token, no streaming."""
    b = dict(body)  # only top-level fields change: a shallow copy leaves the client's body as it was
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


def single_prefill(b: dict[str, Any]) -> dict[str, Any]:
    """A push-mode P leg computes one prefill and pushes it once, whatever D's ``n``:
    ``n`` 1 and no ``best_of`` (D's child requests share that one push)."""
    b["n"] = 1
    b.pop("best_of", None)
    return b


def push_legs(body: dict[str, Any], p: Instance, transfer_id: str, lane: int | None, lease_id: str | None):
    # a secret per transfer: P pushes only to the registration that carries it, so
    # whoever learns the transfer id (a log, another tenant) cannot receive the KV
    key = new_transfer_key()
    return (
        single_prefill(prefill_body(body, prefill_leg_params(transfer_id, lane, lease_id, transfer_key=key))),
        decode_body(body, decode_leg_params(transfer_id, p.kv_addr, transfer_key=key, tp_size=p.tp_size)),
    )


def p_tp_of(p_answer: dict[str, Any]) -> int:
    """P's TP size as its answer to a push-mode P leg names it (0: not named)."""
    kv = p_answer.get("kv_transfer_params")
    kp = kv.get("kvpath") if isinstance(kv, dict) else None
    tp = kp.get("tp_size") if isinstance(kp, dict) else None
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= MAX_P_TP else 0


def with_p_tp(d_body: dict[str, Any], tp_size: int) -> dict[str, Any]:
    """D's leg naming P's TP size (D's ranks choose their P ranks by it)."""
    if tp_size:
        d_body["kv_transfer_params"]["kvpath"]["tp_size"] = tp_size
    return d_body


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
        single_prefill(prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False})),
        decode_body(body, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": p.engine_id,
            "remote_request_id": remote_rid, "remote_host": host, "remote_port": port, "tp_size": 1,
        }),
    )


MAX_N = 128  # completions per request (vLLM sets no bound: one request could fan out without end)


def unsupported_field(body: dict[str, Any], mode: str) -> tuple[str, str] | None:
    """(field, message) when the request asks for what ``mode`` cannot serve or gives a
    field the proxy must not pass on as it is, else None (the proxy answers 400).

    - ``n``: an integer 1..MAX_N in every mode. vLLM's pydantic takes ``"2"`` for 2, so
      a string would pass every check here as a string and fan out on the engines:
      refused, never passed on. In ``push`` mode ``n`` > 1 is served (the P leg has
      ``n`` 1, one prefill and one push, which D's child requests share); in
      ``inproc-push`` it is refused (vLLM's NixlPushConnector gives each child request
      the one registration of its parent, so one push cannot serve them); ``pull``
      passes it on.
    - ``best_of``: vLLM 0.32 has no such field (the completions request takes and
      ignores it), so a value above 1 would be silently not honoured: refused in every
      mode; 1 (or null) passes and is dropped from the P leg.
    - ``prompt``: a batch of prompts (a list of strings or of token-id lists) in the
      push modes: vLLM makes one request per prompt, all with the same
      ``kv_transfer_params``, and one push serves one prompt. A batch of one passes."""
    n = body.get("n")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            return "n", f"n: must be an integer from 1 to {MAX_N}, got {_shown(n)}"
        if n > 1 and mode == "inproc-push":
            return "n", (f"n: n={n} is not supported in {mode} mode (the child requests of one vLLM request "
                         f"share its kv_transfer_params, so one KV push cannot serve them); "
                         f"send {n} separate requests with n=1 instead")
    best_of = body.get("best_of")
    if best_of is not None and (not isinstance(best_of, int) or isinstance(best_of, bool) or best_of != 1):
        if isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > 1:
            return "best_of", (f"best_of: best_of={best_of} is not supported: vLLM ignores best_of, so the answer "
                               f"would not be the best of {best_of}; send n={best_of} and choose among the completions")
        return "best_of", f"best_of: must be the integer 1 when given, got {_shown(best_of)}"
    prompt = body.get("prompt")
    if mode != "pull" and isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        return "prompt", (f"prompt: a batch of {len(prompt)} prompts is not supported in {mode} mode (vLLM makes one "
                          f"request per prompt and one KV push serves one prompt); send one request per prompt")
    return None


def _shown(v: Any) -> str:
    """A client's value in an error message, short (a hostile body must not come back whole)."""
    text = repr(v) if not isinstance(v, str) else f"the string {v!r}"
    return text if len(text) <= 60 else text[:60] + "..."


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
