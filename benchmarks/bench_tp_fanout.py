"""Control fan-out to TP workers: how long one connector command takes to reach every TP rank's engine thread.

vllm-mq is kvpath's path today: the coordinator (vLLM's EngineCore) enqueues the metadata on
vLLM's shared-memory MessageQueue (one writer, TP local readers); each worker's main thread
dequeues it and hands it to kvpath's EngineThread (SimpleQueue + one-byte wake on an inproc
ZMQ PAIR), which acks on the worker's response MessageQueue(1, 1), read rank by rank as
vLLM's MultiprocExecutor does. sequential / threads / asyncio (as kvcached's TP IPC
benchmark) use a direct channel per rank, a ZMQ DEALER to a ROUTER over ipc:// that the
engine thread polls beside its wake socket: one rank after the other, one pool thread per
rank, or one coroutine per rank. Latency: from the send until every rank's ack is in. CPU:
the coordinator's process time plus every worker's, read in-band around the measured ops.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_tp_fanout.py [--tp 1,2,4] [--ops 2000]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

# the script's parts, modules beside it (on sys.path when it runs)
from tp_fanout_coordinator import FANOUTS, Fanout
from tp_fanout_workers import Op, make_op, start_workers

logger = logging.getLogger("bench_tp_fanout")

METHODS = ("vllm-mq", "sequential", "threads", "asyncio")
OPERATIONS = ("registration", "push-start")


@dataclass
class Row:
    method: str
    operation: str
    tp: int
    ops: int
    mean_us: float
    p95_us: float
    max_us: float
    min_us: float
    wall_per_op_us: float
    cpu_per_op_us: float  # coordinator + every worker
    coordinator_cpu_per_op_us: float
    cores_busy: float  # that CPU time / wall time


def measure(fan: Fanout, kind: str, n_ops: int, warmup: int, seq: int, tick: Callable[[], None]) -> Row:
    rng = random.Random(seq)  # the same payloads for every method
    ops = [make_op(seq + i, kind, rng) for i in range(warmup + n_ops)]
    fan.timed(ops[:warmup], lambda: None)
    before = fan.fanout(Op(seq - 1, "cpu"))
    c0, w0 = time.process_time(), time.perf_counter()
    lat = np.array(fan.timed(ops[warmup:], tick)) / 1000
    wall, coord = time.perf_counter() - w0, time.process_time() - c0
    total = coord + sum(a[2] for a in fan.fanout(Op(seq - 2, "cpu"))) - sum(b[2] for b in before)
    return Row(fan.name, kind, fan.tp, n_ops, float(lat.mean()), float(np.percentile(lat, 95)), float(lat.max()),
               float(lat.min()), wall / n_ops * 1e6, total / n_ops * 1e6, coord / n_ops * 1e6, total / wall)


def run_config(method: str, tp: int, n_ops: int, warmup: int, tmpdir: str, tick: Callable[[], None]) -> list[Row]:
    workers = start_workers(method, tp, tmpdir)
    fan: Fanout | None = None
    try:
        fan = FANOUTS[method](workers)
        return [measure(fan, kind, n_ops, warmup, 1_000_000 * (i + 1), tick) for i, kind in enumerate(OPERATIONS)]
    finally:
        try:
            if fan is not None:
                fan.close()
        finally:
            workers.stop()


def run(methods: list[str], tps: list[int], n_ops: int, warmup: int, console: Console) -> list[Row]:
    from multiprocessing import resource_tracker

    if "vllm-mq" in methods:  # before any fork, so that no worker imports vLLM (seconds) on its own
        import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401
    resource_tracker.ensure_running()  # before any fork: one tracker, which unlinks what a crash leaks
    rows: list[Row] = []
    # auto_refresh off: no refresher thread in the coordinator when it forks, none in its CPU time
    with tempfile.TemporaryDirectory(prefix="kvfan-") as tmpdir, \
            Progress(console=console, auto_refresh=False, transient=True) as progress:
        task = progress.add_task("fan-out", total=len(methods) * len(tps) * len(OPERATIONS) * n_ops)
        count = iter(range(1, 1 << 62))

        def tick() -> None:
            if next(count) % 250 == 0:
                progress.update(task, advance=250, refresh=True)
        for tp in tps:
            for method in methods:
                progress.update(task, description=f"{method} TP {tp}", refresh=True)
                rows.extend(run_config(method, tp, n_ops, warmup, tmpdir, tick))
    return rows


def cpu_sample() -> np.ndarray:
    """(monotonic s, machine busy CPU s, steal s, this run's CPU s incl. reaped workers)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    hz, t = os.sysconf("SC_CLK_TCK"), os.times()
    return np.array([time.monotonic(), (user + nice + system + irq + softirq) / hz, steal / hz,
                     t.user + t.system + t.children_user + t.children_system])


def print_table(rows: list[Row], note: str) -> None:
    console = Console()
    if not console.is_terminal:
        console.width = 150  # a file or a pipe: the whole table, no ellipses
    t = Table(title="Control fan-out to TP workers: one operation to every rank's engine thread and back (µs)",
              caption=note)
    for col in ("method", "operation", "TP", "mean", "p95", "max", "min", "wall/op", "CPU/op", "coord CPU/op",
                "cores busy"):
        t.add_column(col, justify="left" if col in ("method", "operation") else "right")
    for r in rows:
        t.add_row(r.method, r.operation, str(r.tp), *(f"{v:.0f}" for v in (
            r.mean_us, r.p95_us, r.max_us, r.min_us, r.wall_per_op_us, r.cpu_per_op_us, r.coordinator_cpu_per_op_us)),
            f"{r.cores_busy:.2f}")
    console.print(t)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _list(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            values = list(dict.fromkeys(kind(v.strip()) for v in text.split(",") if v.strip()))
        except ValueError:
            values = []
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return values
    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bench_tp_fanout.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=_list(int, lambda v: 1 <= v <= 8, "TP sizes in 1-8, comma separated"),
                   default=[1, 2, 4], help="worker process counts, comma separated (default 1,2,4; 8 is allowed "
                   "and measures oversubscription on a 2-core machine)")
    p.add_argument("--methods", type=_list(str, lambda v: v in METHODS, f"some of {','.join(METHODS)}"),
                   default=list(METHODS), help=f"fan-out methods, comma separated (default {','.join(METHODS)})")
    p.add_argument("--ops", type=_positive, default=2000,
                   help="measured operations per method, operation and TP (default %(default)s)")
    p.add_argument("--warmup", type=_positive, default=200, help="unmeasured operations before (default %(default)s)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the rows and the run's CPU use as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C, through the finally blocks
    cores = len(os.sched_getaffinity(0))
    if over := [tp for tp in args.tp if tp + 1 > cores]:
        logger.warning("TP %s: that many worker processes and the coordinator on %d cores measure oversubscription "
                       "(vllm-mq's readers spin on sched_yield)", ",".join(map(str, over)), cores)
    s0 = cpu_sample()
    try:
        rows = run(args.methods, args.tp, args.ops, args.warmup, Console(stderr=True))
    except (TimeoutError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted (every worker stopped)")
        return 130
    wall, busy, steal, ours = cpu_sample() - s0
    others = max(0.0, busy - ours) / wall
    print_table(rows, f"{args.ops} ops each after {args.warmup} warm-up, back to back, {wall:.0f} s on {cores} cores; "
                f"this run used {ours / wall:.2f} cores on average, other processes {others:.2f}, steal "
                f"{steal / wall:.2f}: contention inflates the tails")
    if args.json:
        args.json.write_text(json.dumps({"cores": cores, "wall_s": wall, "ours_cores": ours / wall,
                                         "others_cores": others, "steal_cores": steal / wall, "ops": args.ops,
                                         "warmup": args.warmup, "rows": [asdict(r) for r in rows]}, indent=1))
        logger.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
