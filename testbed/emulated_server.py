"""An emulated vLLM engine with KVPathConnector, served OpenAI-style.

    python -m kvpath.testbed.emulated_server --role prefill|decode --host IP --port N
        --kv-host IP --kv-port N [--model llama-3-8b] [--accelerator h100]
        [--scale-b 500] [--scale-s 500] [--lanes 4] [--fabric small --fabric-host l0h0
        --kernel-oracle kvp-ab12] [--reservation-url URL] [--ucx-dev eth0] [--trace FILE]

Towards the proxy it behaves like ``vllm serve`` with KVPathConnector in that role:
``/v1/completions`` (streamed or not, prompts as text or token ids), the
``kv_transfer_params`` of ``connector/params.py``, ``/health``, ``/v1/models``, and
``/metrics`` with vLLM's KV usage gauge. Compute is emulated by
:mod:`kvpath.testbed.emulated_core`; the KV bytes (the model's per token, divided by S) are
real and move over the connector's lanes. ``/kvpath/records`` returns each finished
request's timestamps for the testbed's trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.params import BadTransferParams, parse_decode, parse_prefill
from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.layer_push import GRANULARITIES
from kvpath.logs import configure as configure_logging
from kvpath.reservation.wire import RESERVE_AT
from kvpath.testbed.emulated_core import EmulatedEngine, EmuRequest, EngineSpec

logger = logging.getLogger(__name__)


def _error(status: int, msg: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "BadRequestError", "param": param, "code": status}},
                        status_code=status)


def _prompt_tokens(body: dict[str, Any]) -> int:
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return len(p)
    if isinstance(p, str) and p:
        return len(p.split())
    raise ValueError("prompt must be a non-empty string or a list of token ids")


def create_app(engine: EmulatedEngine, model_name: str, connector: Any = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()
        if connector is not None:
            connector.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        try:
            n_prompt = _prompt_tokens(body)
        except ValueError as e:
            return _error(400, str(e), "prompt")
        max_tokens = body.get("max_tokens", 16)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer", "max_tokens")
        rid = f"cmpl-{request.headers.get('x-request-id') or uuid.uuid4().hex}-0"
        req = EmuRequest(rid, n_prompt, max_tokens)
        params = body.get("kv_transfer_params")
        try:
            if engine.spec.role == "prefill":
                pp = parse_prefill(params, rid)
                if pp is not None:
                    req.transfer_id, req.lane, req.lease_id = pp.transfer_id, pp.lane, pp.lease_id
                    req.transfer_key = pp.transfer_key
            else:
                dp = parse_decode(params)
                if dp is not None:
                    req.transfer_id, req.peer, req.transfer_key = dp.transfer_id, dp.peer, dp.transfer_key
        except BadTransferParams as e:
            return _error(400, str(e), "kv_transfer_params")
        created = int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if engine.spec.role == "prefill":
            await engine.prefill(req)
            out = chunk(" t0", "length")
            out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1}
            # as KVPathConnector's P answers: its TP size (1 here), which the proxy learns
            kp = params.get("kvpath") if isinstance(params, dict) else None
            out["kv_transfer_params"] = {**params, "kvpath": {**kp, "tp_size": 1}} if isinstance(kp, dict) else params
            return JSONResponse(out)

        if body.get("stream"):
            async def events():
                try:
                    async for i in engine.generate(req):
                        last = i + 1 >= max_tokens
                        yield f"data: {json.dumps(chunk(f' t{i}', 'length' if last else None))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if req.completion is None:
                        engine.abort(req)
            return StreamingResponse(events(), media_type="text/event-stream")
        texts = [f" t{i}" async for i in engine.generate(req)]
        out = chunk("".join(texts), "length")
        out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": len(texts),
                        "total_tokens": n_prompt + len(texts)}
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "kvpath-emulated"}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        # the gauge name vLLM uses, so the same scrapers work
        text = (f'vllm:kv_cache_usage_perc{{model_name="{model_name}"}} {engine.pool.usage}\n'
                + "".join(f"kvpath_emulated_{k}_total {v}\n" for k, v in engine.counters.items()))
        if connector is not None:
            text += "".join(f"kvpath_{k}_total {v}\n" for k, v in connector.stats.snapshot().items()
                            if isinstance(v, (int, float)))
        return Response(text, media_type="text/plain")

    @app.post("/kvpath/connect")
    async def connect(request: Request) -> Response:
        """D: handshake with these P peers now (``{"peers": ["ip:port", ...]}``)."""
        body = await request.json()
        peers = body.get("peers") if isinstance(body, dict) else None
        if engine.receiver is None:
            return _error(400, "only a decode engine connects to prefill peers")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            return _error(400, "peers must be a list of host:port strings", "peers")
        try:
            for p in peers:
                engine.receiver.connect(p)
        except ValueError as e:
            return _error(400, str(e), "peers")
        return JSONResponse({"ok": True, "peers": len(peers)})

    @app.get("/kvpath/records")
    async def records() -> dict:
        return {"role": engine.spec.role, "records": list(engine.records), "counters": engine.counters,
                "kv_usage": engine.pool.usage}

    return app


def build(args: argparse.Namespace) -> tuple[FastAPI, Any]:
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.models import kv_bytes_per_token, model_preset

    if args.scale_b <= 0 or args.scale_s <= 0:
        raise ConfigError("--scale-b and --scale-s must be > 0")
    model = IterationTimeModel.preset(args.model, args.accelerator)
    kvb = max(1, round(kv_bytes_per_token(model_preset(args.model)) / args.scale_s))
    spec = EngineSpec(role=args.role, kv_bytes_per_token=kvb, num_blocks=args.num_blocks,
                      time_scale=args.scale_b / args.scale_s, max_batch_tokens=args.max_batch_tokens)
    if args.push_granularity == "layer":
        # one region per layer, as vLLM's per-layer KV tensors: a layer group is a run of regions
        layers = model_preset(args.model).layers
        spec = dataclasses.replace(spec, layers=layers, push_granularity="layer", layer_group=args.layer_group)
    per_layer = -(-spec.block_bytes // spec.layers)  # a block's bytes of one layer (rounded up)
    buf = np.zeros(spec.layers * spec.num_blocks * per_layer, dtype=np.uint8)
    region = spec.num_blocks * per_layer
    spans = [(buf.ctypes.data + k * region, region) for k in range(spec.layers)]
    layout = layout_from_buffers(spans, spec.num_blocks, spec.block_size)
    cfg = KVPathConfig(lanes=args.lanes, side_channel_host=args.kv_host, side_channel_port=args.kv_port,
                       ucx_net_devices=args.ucx_dev or None, trace_path=args.trace or None,
                       engine_id=args.engine_id or None, reservation_url=args.reservation_url or None,
                       fabric_host=args.fabric_host or None, fabric_spec=args.fabric or None,
                       kernel_oracle=args.kernel_oracle or None, lane_candidates=args.lane_candidates,
                       reserve_at=args.reserve_at, control_key=args.control_key or None,
                       control_trusted_keys=args.control_trusted_keys or None,
                       control_plaintext=args.control_plaintext,
                       reservation_token_file=args.reservation_token_file or None,
                       idle_poll_s=0.05, registration_timeout_s=30.0, max_wait_s=300.0,
                       push_granularity=args.push_granularity, push_layer_group=args.layer_group,
                       uplink_pushes=args.uplink_pushes, push_order=args.push_order,
                       uplink_slots_dir=args.uplink_slots_dir)
    cfg.validate()
    if args.role == "prefill":
        from kvpath.connector.sender import PushSender

        conn: Any = PushSender(cfg, layout, spans, engine_id=cfg.engine_id).start()
        engine = EmulatedEngine(spec, model, sender=conn)
    else:
        from kvpath.connector.receiver import PushReceiver

        conn = PushReceiver(cfg, layout, spans, engine_id=cfg.engine_id).start()
        engine = EmulatedEngine(spec, model, receiver=conn)
    app = create_app(engine, args.model, conn)
    app.state.kv_buffer = buf  # the memory NIXL registered lives as long as the app
    return app, conn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpath.testbed.emulated_server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-host", default="127.0.0.1", help="P: where D's registrations reach the writer")
    ap.add_argument("--kv-port", type=int, default=KV_SIDE_CHANNEL_PORT)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--accelerator", default="h100")
    ap.add_argument("--scale-b", type=float, default=1.0, help="link rates divided by B")
    ap.add_argument("--scale-s", type=float, default=1.0, help="KV bytes divided by S")
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--lane-candidates", type=int, default=4)
    ap.add_argument("--fabric", default="")
    ap.add_argument("--fabric-host", default="")
    ap.add_argument("--kernel-oracle", default="")
    ap.add_argument("--reservation-url", default="")
    ap.add_argument("--uplink-pushes", type=int, default=0, help="the connector's uplink_pushes (0: no cap)")
    ap.add_argument("--push-order", default="fifo", help="the connector's push_order: fifo or srpt")
    ap.add_argument("--uplink-slots-dir", default="/dev/shm", help="the connector's uplink_slots_dir")
    ap.add_argument("--reserve-at", choices=RESERVE_AT, default="admission")
    ap.add_argument("--ucx-dev", default="")
    ap.add_argument("--trace", default="")
    ap.add_argument("--engine-id", default="")
    ap.add_argument("--control-key", default="", help="the connector's control_key (a NAME.key_secret file)")
    ap.add_argument("--control-trusted-keys", default="", help="the connector's control_trusted_keys (a directory)")
    ap.add_argument("--control-plaintext", action="store_true", help="no keys (loopback only)")
    ap.add_argument("--reservation-token-file", default="",
                    help="the connector's reservation_token_file (a file holding the reservation service's token)")
    ap.add_argument("--push-granularity", choices=GRANULARITIES, default="request",
                    help="P: push each request's KV after its prefill, or layer by layer while it computes")
    ap.add_argument("--layer-group", type=int, default=4, help="P, layer-wise: layers per WRITE")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    configure_logging(args.verbose)
    try:
        app, _ = build(args)
    except (ConfigError, ValueError, KeyError) as e:
        ap.error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
