"""benchmarks/serve_compare.py's runs: a session's engines up through the testbed, one
`vllm bench serve` per grid point with the CPU sampled, and each row's checks (the
testbed's fidelity, failed requests, vLLM's KV-loss counters, pushes lost or not ok in the
connectors' records and the engines' logs) (a module the script imports, not a script)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import Progress

from kvpath.testbed.cpu_sampler import CPU_PARTS, CpuSampler
from serve_compare_bench import BenchClient, bench_argv, parse_bench_result
from serve_compare_plan import (BENCH_START_S, SETUP_S, Point, Session, Setup, connector_and_mode, mode_policy,
                                point_estimate_s, session_estimate_s)
from serve_compare_rows import RunRow, number_text


OTHERS_MAX = 20.0  # % of the CPU used outside this comparison above which a row is marked: another tenant ran
REST_S = 4.0  # CPU idle sampled with the engines up and no request, once per session (part of SETUP_S)

# NixlPushConnector's words for a lost push: P's lease ran out with nobody reading its
# blocks; D's registration timed out without a push completion
LOST_PUSH = "retrieved by 0 remote worker(s) before lease expired"
D_GAVE_UP = re.compile(r"registration for request \S+ timed out")


def _part_of(cmdline: list[str]) -> str:
    """Which part a direct child of this script is, by its command line."""
    text = " ".join(cmdline)
    if " proxy " in f" {text} ":
        return "proxy"
    if "--bench-runner" in text or " bench serve" in text:
        return "bench"
    return "engines"  # `vllm serve` or emulated_server, each in its host's namespace


def _count_in(path: Path, pattern: str | re.Pattern[str]) -> tuple[int, str]:
    """How many lines of ``path`` match, and the last of them."""
    if not path.exists():
        return 0, ""
    n, last = 0, ""
    for line in path.read_text(errors="replace").splitlines():
        if (pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line):
            n, last = n + 1, line.strip()
    return n, last


def lost_push_evidence(out: Path) -> list[str]:
    """NixlPushConnector's lost pushes in a session's engine logs: how many, and the last line."""
    found = []
    for pattern, role, what in ((LOST_PUSH, "prefill", "pushes lost"),
                                (D_GAVE_UP, "decode", "registrations timed out")):
        for f in sorted((out / "logs").glob(f"{role}-*.log")):
            n, line = _count_in(f, pattern)
            if n:
                found.append(f"{f.name}: {n} {what}; last: {line[:300]}")
    return found


def _in_tree_losses(serving: Any) -> dict[str, tuple[int, str]]:
    site = serving.site
    return {"lost": _count_in(site.engine_log("prefill", site.p_hosts[0]), LOST_PUSH),
            "d_gave_up": _count_in(site.engine_log("decode", site.d_hosts[0]), D_GAVE_UP)}


def run_point(serving: Any, session: Session, point: Point, seed: int, tokenizer: Path, request_timeout_s: float,
              client: BenchClient, console: Console) -> RunRow:
    """`vllm bench serve` for one grid point on engines that are up; the row with its checks."""
    from kvpath.testbed.orchestrator import pushes
    from kvpath.testbed.run_report import Joined, fidelity, spine_bytes_p_to_d

    setup, site = session.setup, serving.site
    row = RunRow(setup.engine, session.mode, session.round, point.input_len, point.output_len, point.rate,
                 setup.prompts)
    tag = f"in{point.input_len}-out{point.output_len}-qps{point.rate:g}"
    out = site.out / "bench"
    out.mkdir(exist_ok=True)
    result = out / f"{tag}.json"
    argv = bench_argv(serving.proxy_url, serving.engines.model_name, tokenizer, point, setup.prompts, seed, out,
                      result.name)
    base = serving.counters()
    kv0 = serving.engines.kv_loss()
    logs0 = _in_tree_losses(serving) if session.mode == "nixl-push" else {}
    limit = 2 * BENCH_START_S[client.kind, True] + setup.prompts / point.rate + 2 * request_timeout_s + 60
    started = time.time()
    with CpuSampler(_part_of) as cpu:
        rc = client.run(argv, out / f"{tag}.log", limit)
    row.wall_s = time.time() - started
    if rc is None:
        row.error = (f"vllm bench serve did not finish in {limit:.0f} s, or its process died "
                     f"(see {out / (tag + '.log')})")
        return row
    if rc != 0 or not result.exists():
        tail = (out / f"{tag}.log").read_text(errors="replace").strip().splitlines()[-3:]
        row.error = f"vllm bench serve exited {rc}: {' / '.join(tail)[:400]}"
        return row
    b = parse_bench_result(result)
    row.result_file = str(result)
    for k in ("completed", "failed", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms", "req_s",
              "duration_s"):
        setattr(row, k, getattr(b, k))
    # the bench's measured window ends when it wrote its result
    end = result.stat().st_mtime
    data = serving.run_data()
    window = cpu.between(end - b.duration_s, end)
    data.cpu_idle = [c.idle for c in window]
    row.cpu_idle_median = statistics.median(data.cpu_idle) if window else None
    row.cpu_parts_median = {k: statistics.median([c.parts[k] for c in window]) for k in CPU_PARTS} if window else {}
    row.engines_wait_median = statistics.median([c.engines_wait for c in window]) if window else None
    row.cpu_samples = [[round(c.at - (end - b.duration_s), 2), c.idle, *(round(c.parts[k], 1) for k in CPU_PARTS),
                        round(c.engines_wait, 2)] for c in window]
    time.sleep(1.0)  # the last pushes' records and counters
    serving.count_since(data, base)
    flows = []
    if site.cfg.pushes:
        spec = site.fabric.spec
        def when(t: Any) -> float:
            return t.submit_at or t.prefill_done_at or t.registered_at or 0.0

        mine = [p for p in pushes(site) if started <= when(p.record) <= time.time()]
        row.pushes = len(mine)
        flows = [{"bytes": p.record.bytes, "src_ip": spec.host_ip(p.p_host), "src_port": int(p.record.src_port or 0)}
                 for p in mine if p.record.status == "ok"]
        row.timeline_ms = timeline_ms(mine)
        bad = [p.record for p in mine if p.record.status != "ok"]
        if bad:
            row.connector.append(f"{len(bad)} of {len(mine)} pushes not ok")
            row.evidence += [f"push {t.transfer_id}: {t.status} {t.detail}"[:300] for t in bad[:3]]
    row.fidelity = fidelity(data, Joined(flows=flows), serving.lone_flow_ratio)
    row.kv_bytes_on_spines = spine_bytes_p_to_d(data, site.fabric.spec.host_ip)
    row.machine = list(row.fidelity["problems"])
    if row.cpu_others_median is not None and row.cpu_others_median > OTHERS_MAX:
        row.machine.append(f"processes outside this comparison used {row.cpu_others_median:.0f}% of the CPU "
                           f"(> {OTHERS_MAX:.0f}%)")
    if b.failed:
        row.connector.append(f"{b.failed} of {b.completed + b.failed} requests failed")
        row.evidence += b.errors[:3]
    kv1 = serving.engines.kv_loss()
    if kv0 is not None and kv1 is not None:
        lost = {k: kv1[k] - kv0.get(k, 0) for k in kv1 if k != "engines_reporting" and kv1[k] - kv0.get(k, 0)}
        if lost:
            row.connector.append("vLLM's KV-loss counters: " + ", ".join(f"{k} +{v}" for k, v in lost.items()))
    if logs0:
        for key, what, who in (("lost", "pushes lost", "P"), ("d_gave_up", "registrations timed out", "D")):
            n1, line = _in_tree_losses(serving)[key]
            if n1 > logs0[key][0]:
                row.connector.append(f"{n1 - logs0[key][0]} {what} ({who}'s log)")
                row.evidence.append(f"{who}: {line[:300]}")
    console.log(f"{session.name} {tag} ({row.wall_s:.0f} s): {b.completed} ok, {b.failed} failed, "
                f"{row.kv_bytes_on_spines / 1e6:.1f} MB P->D over the spines, TTFT mean "
                f"{number_text(b.ttft_mean_ms)} ms, CPU idle {number_text(row.cpu_idle_median)}% ("
                + ", ".join(f"{k} {v:.0f}%" for k, v in row.cpu_parts_median.items()) + f"), {row.verdict()}")
    return row


def timeline_ms(pushes: Sequence[Any]) -> dict[str, float | None]:
    """Median ms per part of a request over the ok pushes (one per request: its first
    flow at TP > 1). The client's own ends are not known here: `vllm bench serve` keeps
    no per-request send times."""
    from kvpath.request_timeline import median_parts, timeline_of

    first: dict[str, Any] = {}
    for p in pushes:
        if p.record.status == "ok":
            first.setdefault(p.record.transfer_id, p)
    lines = [timeline_of(p.record, p.received_at) for p in first.values()]
    return {k: None if v is None else v * 1e3 for k, v in median_parts(lines).items()} if lines else {}


# -- sessions ---------------------------------------------------------------------------

def run_config(session: Session, out: Path, request_timeout_s: float, seed: int) -> Any:
    from kvpath.testbed.run_config import RunConfig

    s = session.setup
    connector, mode = connector_and_mode(session.mode)
    lens = [p.input_len for p in s.points]
    return RunConfig(out=str(out), fabric=s.fabric, pools=s.pools, engine=s.engine, connector=connector, mode=mode,
                     scale_b=s.scale_b, scale_s=s.scale_s, policy=mode_policy(session.mode, s.policy),
                     min_prompt=min(lens), max_prompt=max(lens),
                     max_output=max(p.output_len for p in s.points), requests=s.prompts,
                     qps=max(p.rate for p in s.points), timeout_s=request_timeout_s, seed=seed)


def point_seed(seed: int, setup: Setup, point: Point) -> int:
    """The same prompts for every mode and round at a point, other prompts at other points
    (no prefix shared across points: vLLM's prefix cache)."""
    return seed + setup.points.index(point)


def run_session(session: Session, workdir: Path, tokenizers: dict[str, Path], request_timeout_s: float, seed: int,
                client: BenchClient, console: Console, progress: Progress, task: Any) -> list[RunRow]:
    from kvpath.testbed.orchestrator import serving

    setup = session.setup
    out = workdir / setup.engine / f"r{session.round}-{session.mode}"
    out.mkdir(parents=True, exist_ok=True)
    if setup.engine == "vllm":  # one tiny model for every session (build_tiny_model keeps a built one)
        link = out / "tiny-model"
        if not link.exists():
            link.symlink_to(tokenizers["vllm"].resolve(), target_is_directory=True)
    cfg = run_config(session, out, request_timeout_s, seed)
    rows: list[RunRow] = []
    progress.update(task, description=f"{session.name}: starting")
    t0 = time.time()
    try:
        with serving(cfg, console) as s:
            setup_s = time.time() - t0
            with CpuSampler(_part_of) as rest:  # the engines up, no request: what they cost idle
                time.sleep(REST_S)
            at_rest = statistics.median([c.idle for c in rest.samples]) if rest.samples else None
            console.log(f"{session.name}: up in {setup_s:.0f} s (fabric {s.fabric.prefix}, proxy {s.proxy_url}, "
                        f"lone flow at {s.lone_flow_ratio:.2f} of the link rate); CPU idle at rest "
                        f"{number_text(at_rest)}%")
            progress.advance(task, SETUP_S[setup.engine])
            for p in setup.points:
                progress.update(task, description=f"{session.name}: in {p.input_len} out {p.output_len} "
                                                  f"at {p.rate:g} req/s")
                rows.append(run_point(s, session, p, point_seed(seed, setup, p), tokenizers[setup.engine],
                                      request_timeout_s, client, console))
                rows[-1].session_setup_s, rows[-1].cpu_idle_at_rest = setup_s, at_rest
                progress.advance(task, point_estimate_s(setup.engine, session.mode, p, setup.prompts, client.kind))
    except Exception as e:  # httpx timeouts, a bad result file...: this session's points fail, the others go on
        evidence = lost_push_evidence(out) if session.mode == "nixl-push" else []
        console.log(f"[red]{session.name}: {e}[/red]" + "".join(f"\n  {x}" for x in evidence))
        done = {(r.input_len, r.output_len, r.rate) for r in rows}
        for p in setup.points:
            if (p.input_len, p.output_len, p.rate) not in done:
                rows.append(RunRow(setup.engine, session.mode, session.round, p.input_len, p.output_len, p.rate,
                                   setup.prompts, error=f"session failed: {str(e)[:300]}"
                                   + ("; the engines' logs: lost pushes" if evidence else ""), evidence=evidence))
    console.log(f"{session.name}: {time.time() - t0:.0f} s in all "
                f"(estimated {session_estimate_s(setup, session.mode, client.kind):.0f})")
    return rows
