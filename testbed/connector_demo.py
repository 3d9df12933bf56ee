"""``kvpath connector demo``: a tiny model, real P and D vLLM servers with KVPathConnector
(started by :mod:`kvpath.testbed.vllm_server`) and the P-then-D client of
:mod:`kvpath.connector.pd_client`; it prints the completions and the connector's pushes."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpath.connector.pd_client import make_prompts, pd_request
from kvpath.tiny_model import build_tiny_model
from kvpath.trace import ConnectorLog, LaneRecord, read_connector_log
from kvpath.testbed.vllm_server import VLLMServer, connector_config

logger = logging.getLogger(__name__)


def run_demo(workdir: str, n_requests: int = 8, max_tokens: int = 16, lanes: int = 4, base_port: int = 8100) -> int:
    console = Console()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    trace = wd / "p_trace.jsonl"
    trace.unlink(missing_ok=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as prog:
        t = prog.add_task("building the tiny model", total=None)
        model = str(build_tiny_model(wd / "model"))
        prog.update(t, description="starting P (core 0) and D (core 1) vllm servers")
        # the control channel's keys, made for this demo (a prefill and a decode pair)
        keys = wd / "keys"
        shutil.rmtree(keys, ignore_errors=True)
        common = dict(lanes=lanes, ucx_net_devices="lo", keys_dir=keys)
        p = VLLMServer(model, base_port, cpu=0, log_path=str(wd / "p.log"),
                       kv_transfer_config=connector_config("kv_producer", base_port + 500, trace_path=str(trace), **common))
        d = VLLMServer(model, base_port + 100, cpu=1, log_path=str(wd / "d.log"),
                       kv_transfer_config=connector_config("kv_consumer", base_port + 600, **common))
        try:
            p.start()
            d.start()
            p.wait_ready()
            d.wait_ready()
            prog.update(t, description=f"sending {n_requests} requests P-then-D")
            results = asyncio.run(_send(p.url, d.url, f"127.0.0.1:{base_port + 500}", n_requests, max_tokens))
        finally:
            prog.update(t, description="stopping servers")
            p.stop()
            d.stop()
    table = Table(title="P-then-D completions (KVPathConnector)")
    for col in ("#", "prompt", "completion", "e2e ms"):
        table.add_column(col)
    for i, r in enumerate(results):
        table.add_row(str(i), r.prompt[:40] + "...", repr(r.text) if not r.error else f"[red]{r.error[:60]}", f"{r.ttft_s * 1e3:.0f}")
    console.print(table)
    log = read_connector_log(trace) if trace.exists() else ConnectorLog([], [], [])
    pushes = log.transfers
    tt = Table(title=f"KV pushes (trace: {trace})")
    for col in ("transfer", "status", "bytes", "descs", "lane", "src port", "wait for D ms", "push ms"):
        tt.add_column(col)
    for r in pushes:
        wait = (r.submit_at - r.prefill_done_at) * 1e3 if r.submit_at and r.prefill_done_at else 0
        dur = (r.duration_s or 0) * 1e3
        tt.add_row(r.transfer_id[:8], r.status, str(r.bytes), str(r.descriptors), str(r.lane),
                   str(r.src_port), f"{wait:.1f}", f"{dur:.2f}")
    console.print(tt)
    for ev in log.lanes:
        console.print(f"lanes to {ev.peer}: " + ", ".join(_lane(ln) for ln in ev.lanes))
    failed = [r for r in results if r.error]
    console.print(f"{len(results) - len(failed)}/{len(results)} requests ok, {len(pushes)} pushes; logs in {wd}")
    return 1 if failed or len(pushes) != len(results) else 0


def _lane(ln: LaneRecord) -> str:
    ft = ln.five_tuple
    where = f"{ft.src_ip}:{ft.src_port}->{ft.dst_ip}:{ft.dst_port}" if ft else "(5-tuple unknown)"
    return f"lane {ln.lane} {where}" + (f" via {ln.path}" if ln.path else "")


async def _send(p_url: str, d_url: str, peer: str, n: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(pd_request(client, p_url, d_url, peer, pr, max_tokens) for pr in make_prompts(n)))
