"""What several ``kvpath bridge`` verbs share on the command line, declared once: argument
groups, and the readers of option values that end the command with an error naming
the option."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvpath.bridge.ns3_backend import Ns3Params
    from kvpath.trace import Trace

DEFAULT_NS3_QUEUE = 16 << 20  # deep: a lossless approximation where no trace says otherwise


def fail(verb: str, msg: str) -> SystemExit:
    """The error every bridge verb ends with: ``kvpath bridge VERB: error: MSG``, no traceback."""
    return SystemExit(f"kvpath bridge {verb}: error: {msg}")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and the serving model: the published study's shape by default."""
    p.add_argument("--workload", default="zipf", help="zipf, poisson or a trace file (docs/workloads.md)")
    p.add_argument("--requests", type=int, default=500,
                   help="number of requests (a trace file is sampled to it) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the workload's random seed (default %(default)s)")
    p.add_argument("--min-prompt", type=int, default=1024,
                   help="zipf, poisson: shortest prompt, tokens (default %(default)s)")
    p.add_argument("--max-prompt", type=int, default=4096,
                   help="zipf, poisson: longest prompt, tokens (default %(default)s)")
    p.add_argument("--pd-ratio", type=float, default=20.0,
                   help="zipf: output tokens = prompt tokens / this (default %(default)s)")
    p.add_argument("--model", default="llama-3-8b",
                   help="model preset for iteration times and KV bytes per token: llama-3-8b, llama-3-70b, "
                        "qwen2.5-7b (default %(default)s)")
    p.add_argument("--accelerator", default="h100",
                   help="accelerator preset for iteration times: h100, a100, l40s (default %(default)s)")


def add_ns3_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ns3-mtu", type=int, default=None,
                   help="ns3 backend: link MTU (default: the fabric's; up to 65535 for coarse segments)")
    p.add_argument("--ns3-queue-bytes", type=int, default=None,
                   help="ns3 backend: drop-tail queue per port (default: a trace's header's queue_bytes where a "
                        "trace is read, else 16 MiB)")
    p.add_argument("--ns3-tcp", default="TcpCubic", help="ns3 backend: TCP variant (ns-3 type name)")


def ns3_params(args: argparse.Namespace, verb: str, trace: Trace | None = None) -> Ns3Params:
    """The ns3 options; the queue per port is the trace header's when the run recorded
    it (a testbed trace), so ns-3 drops where the testbed's links would."""
    from kvpath.bridge.ns3_backend import Ns3Params
    from kvpath.trace.header import TraceSetup

    queue = args.ns3_queue_bytes
    if queue is None and trace is not None:
        try:
            queue = TraceSetup(trace).queue_bytes
        except ValueError as e:
            raise fail(verb, str(e)) from None
    try:
        return Ns3Params(mtu=args.ns3_mtu, queue_bytes=DEFAULT_NS3_QUEUE if queue is None else queue,
                         tcp=args.ns3_tcp)
    except ValueError as e:
        raise fail(verb, f"--ns3-*: {e}") from None


def load_trace(path: str, verb: str) -> Trace:
    from kvpath.trace import TraceError, read_trace

    try:
        return read_trace(path)
    except (OSError, TraceError) as e:
        raise fail(verb, f"{path}: {e}") from None


def backends(arg: str, verb: str, one: bool = False) -> list[str]:
    """A comma list of registered network backends (``kvpath.bridge.backends.names()``);
    ``one``: a single name, no list."""
    from kvpath.bridge.backends import names as registered

    names = [b for b in arg.split(",") if b]
    if not names or (one and "," in arg) or any(b not in registered() for b in names):
        raise fail(verb, f"--backend: choose from {', '.join(registered())}, got {arg!r}")
    return names


def split(text: str) -> list[str]:
    """A comma list: blanks dropped, order kept, repeats dropped."""
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))


def numbers(text: str, verb: str, flag: str, ok: Callable[[float], bool], want: str) -> list[float]:
    """A comma list of finite numbers that pass ``ok`` (``want`` says what that means),
    repeats dropped, at least one."""
    out = []
    for x in split(text):
        try:
            v = float(x)
        except ValueError:
            raise fail(verb, f"{flag}: not a number: {x!r}") from None
        if not math.isfinite(v) or not ok(v):
            raise fail(verb, f"{flag}: each value must be {want}, got {x!r}")
        out.append(v)
    if not out:
        raise fail(verb, f"{flag}: give at least one value")
    return list(dict.fromkeys(out))
