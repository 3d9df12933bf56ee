"""``kvpath connector demo``: a tiny model (by default briefly trained on the text kvpath
ships, so its output is readable), real P and D vLLM servers with KVPathConnector
(started by :func:`kvpath.testbed.pd_pair.pd_pair`) and the P-then-D client of
:mod:`kvpath.testbed.pd_client`. It prints, per request, the P/D completion, the
decode-only one (a plain request on P) and whether they are equal, then the connector's
pushes; it fails when a request fails, is not pushed, or differs from decode-only."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import shutil
import signal
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpath.testbed.pd_client import PDResult, pd_and_decode_only
from kvpath.testbed.pd_pair import EngineStartError, PDSide, pd_pair
from kvpath.tiny_model import TinyModelSpec, build_tiny_model
from kvpath.tiny_model.training import TRAINED_STEPS, corpus_prompts
from kvpath.trace import ConnectorLog, LaneRecord, read_connector_log

logger = logging.getLogger(__name__)


def run_demo(workdir: str, n_requests: int = 8, max_tokens: int = 16, lanes: int = 4, base_port: int = 8100,
             steps: int = TRAINED_STEPS) -> int:
    console = Console()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    trace = wd / "p_trace.jsonl"
    trace.unlink(missing_ok=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as prog:
        what = f"training the tiny model ({steps} steps, once per machine)" if steps else "building the tiny model"
        t = prog.add_task(what, total=None)
        model = str(build_tiny_model(None, TinyModelSpec(steps=steps)))  # the cached copy
        prog.update(t, description="starting P (core 0) and D (core 1) vllm servers")
        # the control channel's keys, made for this demo (a prefill and a decode pair)
        keys = wd / "keys"
        shutil.rmtree(keys, ignore_errors=True)
        # the engines' API key (vLLM's --api-key, given as VLLM_API_KEY: never in argv),
        # made for this demo and held in memory only: the demo's client sends it
        api_key = secrets.token_urlsafe(24)
        try:
            with pd_pair(model, wd, PDSide(base_port, base_port + 500, trace=True),
                         PDSide(base_port + 100, base_port + 600), knobs=dict(lanes=lanes, ucx_net_devices="lo"),
                         keys_dir=keys, api_key=api_key, stop_signal=signal.SIGTERM) as pair:
                try:
                    prog.update(t, description=f"sending {n_requests} requests decode-only, then P-then-D")
                    refs, results = asyncio.run(_send(pair.p_url, pair.d_url, pair.kv_addr, n_requests, max_tokens,
                                                      pair.p.headers))
                finally:
                    prog.update(t, description="stopping servers")
        # an engine that did not come up, or answered with an error or not at all: one line
        # (and its log's end), not a traceback
        except (EngineStartError, httpx.HTTPError) as e:
            console.print(f"[red]kvpath connector demo: error: {type(e).__name__}: {escape(str(e))}[/red] "
                          f"(logs in {wd})", highlight=False)
            return 1
    console.print(f"model: {model} ({f'trained {steps} steps' if steps else 'random weights'}), greedy, "
                  f"max_tokens {max_tokens}")
    for i, (r, ref) in enumerate(zip(results, refs)):
        _print_request(console, i, r, ref)
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
    same = sum(not r.error and r.text == ref for r, ref in zip(results, refs))
    console.print(f"{len(results) - len(failed)}/{len(results)} requests ok, {len(pushes)} pushes, "
                  f"{same}/{len(results)} P/D == decode-only; logs in {wd}")
    return 1 if failed or len(pushes) != len(results) or same != len(results) else 0


def _print_request(console: Console, i: int, r: PDResult, ref: str) -> None:
    equal = not r.error and r.text == ref
    pd = escape(repr(r.text)) if not r.error else f"[red]error: {escape(r.error[:100])}[/red]"
    tail = escape(repr(r.prompt[-60:]))
    console.print(f"[bold]request {i}[/bold] ({r.ttft_s * 1e3:.0f} ms P-then-D): prompt ...{tail}", highlight=False)
    console.print(f"  P/D:         {pd}", highlight=False)
    console.print(f"  decode-only: {escape(repr(ref))}", highlight=False)
    console.print(f"  P/D == decode-only: {'[green]yes[/green]' if equal else '[red]no[/red]'}", highlight=False)


def _lane(ln: LaneRecord) -> str:
    ft = ln.five_tuple
    where = f"{ft.src_ip}:{ft.src_port}->{ft.dst_ip}:{ft.dst_port}" if ft else "(5-tuple unknown)"
    return f"lane {ln.lane} {where}" + (f" via {ln.path}" if ln.path else "")


async def _send(p_url: str, d_url: str, peer: str, n: int, max_tokens: int,
                headers: dict[str, str] | None = None) -> tuple[list[str], list[PDResult]]:
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:  # headers: the engines' API key
        return await pd_and_decode_only(client, p_url, d_url, peer, corpus_prompts(n), max_tokens)


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(workdir=args.workdir, n_requests=args.requests, max_tokens=args.max_tokens, lanes=args.lanes,
                    base_port=args.base_port, steps=args.steps)


def add_parsers(conn: argparse._SubParsersAction) -> None:
    """``kvpath connector demo`` (in the connector's command group): the connector on real
    vLLM servers, which the testbed starts."""
    d = conn.add_parser("demo", help="tiny model + P and D vllm servers with KVPathConnector + a P-then-D client")
    d.add_argument("--workdir", default="runs/connector-demo",
                   help="logs, keys and trace go here (the model is cached under $KVPATH_CACHE/models, "
                   "default ~/.cache/kvpath/models)")
    d.add_argument("--steps", type=int, default=TRAINED_STEPS,
                   help="the tiny model's training steps on the text kvpath ships, for readable output (once per "
                   "machine, about 20 s on one core); 0: random weights (default %(default)s)")
    d.add_argument("--requests", type=int, default=8, help="requests to send P-then-D (default %(default)s)")
    d.add_argument("--max-tokens", type=int, default=16, help="most output tokens per request (default %(default)s)")
    d.add_argument("--lanes", type=int, default=4,
                   help="connector lanes (NIXL connections) from P to D (default %(default)s)")
    d.add_argument("--base-port", type=int, default=8100,
                   help="P serves on this port, D on +100, their connectors' side channels on +500 and +600 "
                   "(default %(default)s)")
    d.set_defaults(func=_cmd_demo)
