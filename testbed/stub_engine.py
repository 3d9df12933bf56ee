"""A stand-in for a vLLM OpenAI server: the proxy's fast tests and its overhead benchmark.

It answers ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) with
a deterministic text derived from the prompt, echoes ``kv_transfer_params`` the way
a P engine does, records what it received, and can be told to be slow, to fail (with
a Retry-After), to hang, to break or stall a stream midway, or to fail its health
check. Not a product part: real runs use real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpath.proxy.relay import wait_for_disconnect


class StubBroke(RuntimeError):
    """Raised inside a stream to make the server drop the connection mid-answer."""


@dataclass
class StubBehaviour:
    delay_s: float = 0.0  # before answering
    token_delay_s: float = 0.0  # between streamed chunks
    fail_status: int = 0  # answer with this HTTP status
    retry_after: str | None = None  # with fail_status: the Retry-After header
    hang: bool = False  # never answer
    break_after: int = -1  # streams: after this many events, send half an event and drop the connection
    stall_after: int = -1  # streams: after this many events, send nothing more (until the client leaves)
    healthy: bool = True  # False: /health answers 503
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0  # requests whose client went away before the answer
    stream_cancelled: int = 0  # streams whose client went away mid-stream
    keep_records: bool = True
    raw_answer: bytes | None = None  # answer with these bytes (200, JSON content type)
    kv_error: str = ""  # answer a leg as an engine of the wrong kv_role does: kv_transfer_params.error
    tp_size: int = 1  # a P leg's answer names it (kvpath.tp_size), as KVPathConnector's P does


def _text(body: dict[str, Any], n: int) -> list[str]:
    prompt = body.get("prompt") or " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    words = str(prompt).split() or ["x"]
    return [f" {words[(i * 7) % len(words)]}" for i in range(n)]


def create_stub_app(name: str = "stub", behaviour: StubBehaviour | None = None) -> FastAPI:
    app = FastAPI()
    b = behaviour or StubBehaviour()
    app.state.behaviour = b

    async def answer(request: Request, chat: bool) -> Response:
        body = await request.json()
        if b.keep_records:
            b.received.append({"body": body, "headers": dict(request.headers), "t": time.time()})
        wait = 3600.0 if b.hang else b.delay_s
        if wait:
            # like vLLM, notice a client that went away and abort the request
            try:
                await asyncio.wait_for(wait_for_disconnect(request.receive), timeout=wait)
                b.cancelled += 1
                return Response(status_code=499)
            except asyncio.TimeoutError:
                pass
        if b.raw_answer is not None:
            return Response(b.raw_answer, media_type="application/json")
        if b.fail_status:
            return JSONResponse({"error": {"message": f"{name} failed on purpose", "code": b.fail_status}},
                                status_code=b.fail_status,
                                headers={"Retry-After": b.retry_after} if b.retry_after else None)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        toks = _text(body, n)
        kvp = body.get("kv_transfer_params")
        rid = request.headers.get("x-request-id", "req")
        if body.get("stream"):
            async def gen():
                try:
                    async for chunk in chunks():
                        yield chunk
                except (asyncio.CancelledError, GeneratorExit):
                    b.stream_cancelled += 1
                    raise

            async def chunks():
                for i, t in enumerate(toks):
                    if i == b.break_after:
                        yield b'data: {"id": "half an ev'
                        raise StubBroke(f"{name} broke the stream on purpose")  # uvicorn drops the connection
                    if i == b.stall_after:
                        await asyncio.sleep(3600)  # cancelled when the client leaves
                    if b.token_delay_s:
                        await asyncio.sleep(b.token_delay_s)
                    delta = {"delta": {"content": t}} if chat else {"text": t}
                    chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "model": body.get("model"), "choices": [{"index": 0, **delta,
                             "finish_reason": "length" if i == len(toks) - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        text = "".join(toks)
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "model": body.get("model"),
               "choices": [choice], "usage": {"completion_tokens": n}}
        if kvp is not None and b.kv_error:
            out["kv_transfer_params"] = {"error": b.kv_error, "kv_role": "kv_consumer"}
        elif kvp is not None:
            out["kv_transfer_params"] = {**kvp, "do_remote_prefill": True, "do_remote_decode": False, "served_by": name}
            if kvp.get("do_remote_decode") and isinstance(kvp.get("kvpath"), dict) and b.tp_size:
                out["kv_transfer_params"]["kvpath"] = {**kvp["kvpath"], "tp_size": b.tp_size}
        return JSONResponse(out)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": name}]}

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok" if b.healthy else "down"}, status_code=200 if b.healthy else 503)

    return app


class ServerThread:
    """Run an ASGI app with uvicorn in a background thread (tests, benchmarks)."""

    def __init__(self, app: Any, port: int, host: str = "127.0.0.1"):
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                     timeout_graceful_shutdown=1, backlog=4096)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://{host}:{port}"

    def start(self, timeout_s: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
