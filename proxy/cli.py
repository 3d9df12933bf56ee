"""Command-line entry point: ``kvpath proxy``."""

from __future__ import annotations

import argparse
import logging

from kvpath.credentials import CredentialError, header_safe, load_secret, secret_arg
from kvpath.proxy.instances import POLICIES, Instance
from kvpath.proxy.legs import MODES as PROXY_MODES
from kvpath.reservation.cli import add_reservation_args, build_cost, build_service, load_fabric
from kvpath.reservation.wire import RESERVE_AT, TOKEN_ENV as RESERVATION_TOKEN_ENV

logger = logging.getLogger(__name__)
INSTANCE_KEYS = ("kv_addr", "fabric_host", "engine_id", "tp")
CLIENT_KEEPALIVE_S = 65  # the proxy's keep-alive for its clients' idle connections


def parse_instance(spec: str, role: str) -> Instance:
    """``URL[,kv_addr=H:P][,fabric_host=l0h1][,engine_id=ID][,tp=N]`` -> Instance."""
    opt = f"--{role}"
    url, *rest = spec.split(",")
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"kvpath proxy: error: {opt} {spec!r}: the URL must start with http:// or https://")
    kw = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or key not in INSTANCE_KEYS:
            raise SystemExit(f"kvpath proxy: error: {opt} {spec!r}: unknown field {key!r} (known: {', '.join(INSTANCE_KEYS)})")
        kw[key] = value
    tp = kw.pop("tp", None)
    if tp is not None and (not tp.isdigit() or not 1 <= int(tp) <= 1024):
        raise SystemExit(f"kvpath proxy: error: {opt} {spec!r}: tp must be the engine's TP size, 1 to 1024, got {tp!r}")
    return Instance(url.rstrip("/"), role, **kw, tp_size=int(tp or 0))


class DeprecatedAlias(argparse.Action):
    """An old option name kept working: stores into the new option's dest and warns."""

    def __init__(self, *args, new: str, **kw):
        self.new = new
        super().__init__(*args, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        logger.warning("%s is deprecated: use %s", option_string, self.new)
        setattr(namespace, self.dest, values)


ADMIN_TOKEN_ENV = "KVPATH_ADMIN_TOKEN"  # the proxy's /admin token (else --admin-token-file)


ENGINE_API_KEY_ENV = ("KVPATH_ENGINE_API_KEY", "VLLM_API_KEY")  # the proxy's own first, then vLLM's


def load_engine_api_key(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The engines' API key (vLLM's ``--api-key``): from ``--engine-api-key-file``, else
    $KVPATH_ENGINE_API_KEY, else $VLLM_API_KEY (what vLLM itself reads), else None. Never
    from argv. Logs where it came from, never the key."""
    key, source = None, "none"
    try:
        if path:
            key, source = load_secret("--engine-api-key-file", path), "--engine-api-key-file"
        for env in ENGINE_API_KEY_ENV:
            if key is None:
                key, source = load_secret(env, env=env, environ=environ), f"${env}"
    except CredentialError as e:
        raise SystemExit(f"kvpath proxy: error: {e}") from None
    if key is not None and not header_safe(key, spaces=True):
        raise SystemExit(f"kvpath proxy: error: {source}: the engine API key must be one line of printable ASCII")
    logger.info("engine API key: %s", f"from {source}" if key else "none (the engines must run without --api-key)")
    return key


def build_proxy(args: argparse.Namespace):
    """The proxy that ``args`` describe, and the reservation service's app when it runs in
    process (else None). ``args`` as :func:`resolve_args` left them (secrets resolved)."""
    from kvpath.proxy.config import ProxyConfig
    from kvpath.proxy.core import Proxy
    from kvpath.reservation.app import create_app as create_reservation_app
    from kvpath.reservation.clients import HttpReserver, InProcessReserver
    from kvpath.reservation.wire import AsyncReserver

    prefill = [parse_instance(s, "prefill") for s in args.prefill]
    decode = [parse_instance(s, "decode") for s in args.decode]
    reserver: AsyncReserver | None = None
    res_app = None
    if args.mode == "push":
        if args.reservation_shard:
            from kvpath.reservation.shards import ShardedReserver, ShardError, parse_shard

            spec = load_fabric(args.fabric)
            try:
                shards = [parse_shard(s, spec) for s in args.reservation_shard]
                reserver = ShardedReserver(spec, [(leaves, HttpReserver(url, timeout_s=args.reservation_timeout_s,
                                                                        token=args.res_token))
                                                  for leaves, url in shards])
            except ShardError as e:
                raise SystemExit(f"kvpath proxy: error: {e}") from None
        elif args.reservation_url:
            reserver = HttpReserver(args.reservation_url, timeout_s=args.reservation_timeout_s, token=args.res_token)
        elif args.reservation == "inproc":
            svc = build_service(args.fabric, args.res_mode, args.lease_s, args.dc_delay_s, args.kernel_oracle, args.cc_metric,
                        args.lanes_ttl_s)
            cost = build_cost(args, svc.spec)
            reserver = InProcessReserver(svc, cost)
            res_app = create_reservation_app(svc, token=args.res_token, cost=cost)
        if args.reserve_at == "push":
            reserver = None  # P's connectors reserve when their pushes start (reserve_at=push)
    cfg = ProxyConfig(mode=args.mode, policy=args.policy, admin_token=args.admin_token,
                      engine_api_key=args.engine_api_key,
                      first_byte_timeout_s=args.first_byte_timeout_s, chunk_gap_timeout_s=args.chunk_gap_timeout_s,
                      connect_timeout_s=args.connect_timeout_s, health_interval_s=args.health_interval_s,
                      health_timeout_s=args.health_timeout_s, unhealthy_after=args.unhealthy_after,
                      kv_bytes_per_token=args.kv_bytes_per_token, max_body_bytes=args.max_body_bytes)
    try:
        proxy = Proxy(cfg, prefill, decode, reserver)
    except ValueError as e:
        raise SystemExit(f"kvpath proxy: error: {e}") from None
    return proxy, res_app


def resolve_args(args: argparse.Namespace) -> None:
    """Check what the options say together, and resolve the secrets (from files or the
    environment) into ``args``: admin_token, res_token, engine_api_key."""
    for s in args.prefill:
        p = parse_instance(s, "prefill")
        if args.mode != "pull" and not p.kv_addr:
            raise SystemExit(f"kvpath proxy: error: --prefill {p.url}: kv_addr=HOST:PORT is needed in {args.mode} mode")
        if args.mode == "inproc-push" and not p.engine_id:
            raise SystemExit("kvpath proxy: error: --prefill: engine_id=ID is needed in inproc-push mode")
    for s in args.decode:
        parse_instance(s, "decode")
    if not 1 <= args.workers <= 64:
        raise SystemExit(f"kvpath proxy: error: --workers must be from 1 to 64, got {args.workers}")
    if args.reservation_shard and (args.reservation_url or args.reservation == "inproc"):
        raise SystemExit("kvpath proxy: error: --reservation-shard is instead of --reservation-url and "
                         "--reservation inproc: give one of them")
    if args.workers > 1 and args.mode == "push" and not args.reservation_url and args.reservation == "inproc":
        raise SystemExit("kvpath proxy: error: --workers N with --reservation inproc would give each worker its own "
                         "reservation service, each deciding the same free links: run one `kvpath reservation` and "
                         "give every worker its --reservation-url (docs/proxy.md, 'A proxy tier')")
    args.admin_token = secret_arg(args, "proxy", "--admin-token-file", ADMIN_TOKEN_ENV, "--admin-token")
    # never the admin token: every P connector holds the reservation token, and must not
    # thereby hold the proxy's /admin (which redirects user traffic)
    args.res_token = secret_arg(args, "proxy", "--reservation-token-file", RESERVATION_TOKEN_ENV)
    if args.mode == "push":
        remote = "--reservation-shard" if args.reservation_shard else "--reservation-url" if args.reservation_url else ""
        need = (remote if remote and args.reserve_at == "admission"
                else "--reservation inproc" if not remote and args.reservation == "inproc" else "")
        if need and not args.res_token:
            raise SystemExit(f"kvpath proxy: error: {need} needs the reservation service's token: give "
                             f"--reservation-token-file PATH (a file holding it) or set {RESERVATION_TOKEN_ENV} "
                             f"(docs/reservation.md)")
    args.engine_api_key = load_engine_api_key(args.engine_api_key_file)


def cmd_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpath.proxy.app import create_app
    from kvpath.web.heap import freeze_startup_heap

    raw = {k: v for k, v in vars(args).items() if k != "func"}  # the options as given: no secret from a file
    resolve_args(args)
    proxy, res_app = build_proxy(args)
    logger.info("proxy: mode %s, %d prefill, %d decode, on %s:%d%s", args.mode, len(args.prefill), len(args.decode),
                args.host, args.port, f", {args.workers} workers" if args.workers > 1 else "")
    # clients' pools keep idle connections about 5 s (httpx, aiohttp 15 s): a longer keep-alive
    # here means the client, not the proxy, closes an idle one, so no request races its close
    serve = dict(host=args.host, port=args.port, log_level="warning", backlog=4096,
                 timeout_keep_alive=CLIENT_KEEPALIVE_S,
                 # nothing reads a client's address: no X-Forwarded-For rewriting per request
                 proxy_headers=False)
    if args.workers > 1:
        return _serve_tier(args, raw, proxy, serve)
    app = create_app(proxy, res_app)
    freeze_startup_heap()  # built: the app, the pools, every module (kvpath/web/heap.py)
    uvicorn.run(app, **serve)
    return 0


def _serve_tier(args: argparse.Namespace, raw: dict, proxy, serve: dict) -> int:
    """``--workers N``: uvicorn's N worker processes on one socket, each building its
    proxy from the options as given (``raw``, in its environment; each worker reads the
    secrets from their files or the environment itself, so none is written anywhere),
    sharing the instance set and the metrics through a private directory (proxy/tier.py)."""
    import json
    import os
    import shutil
    import tempfile

    import uvicorn

    from kvpath.proxy.tier import METRICS_SUBDIR, RUN_DIR_ENV, WORKER_ENV, SharedInstances

    run_dir = tempfile.mkdtemp(prefix="kvpath-proxy-")  # mode 0700
    try:
        os.mkdir(os.path.join(run_dir, METRICS_SUBDIR))
        SharedInstances(run_dir).publish(proxy.pools)
        # read by prometheus-client when a worker imports it: every worker's values in files
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(run_dir, METRICS_SUBDIR)
        os.environ[RUN_DIR_ENV], os.environ[WORKER_ENV] = run_dir, json.dumps(raw)
        uvicorn.run("kvpath.proxy.cli:worker_app", factory=True, workers=args.workers, **serve)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def worker_app():
    """One worker of ``kvpath proxy --workers N`` (uvicorn calls it in each process)."""
    import json
    import os

    from kvpath.logs import configure as configure_logging
    from kvpath.proxy.app import create_app
    from kvpath.proxy.tier import RUN_DIR_ENV, WORKER_ENV, SharedInstances
    from kvpath.web.heap import freeze_startup_heap

    args = argparse.Namespace(**json.loads(os.environ[WORKER_ENV]))
    configure_logging(getattr(args, "verbose", False))  # spawned: the parent's set-up is not inherited
    try:
        resolve_args(args)  # the secrets from where the parent read them (a token file gone: stop)
        proxy, res_app = build_proxy(args)
    except SystemExit as e:
        logger.error("%s", e.code)
        # uvicorn's code for a worker that failed to start: the parent stops (rather than
        # start it again and again)
        raise SystemExit(3) from None
    proxy.shared = SharedInstances(os.environ[RUN_DIR_ENV])
    app = create_app(proxy, res_app)
    freeze_startup_heap()
    return app


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="the OpenAI-compatible P/D proxy (FastAPI)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default %(default)s)")
    p.add_argument("--workers", type=int, default=1,
                   help="proxy processes on this address (uvicorn workers): one shared reservation service "
                        "(--reservation-url), one /metrics view, /admin changes reach every worker "
                        "(docs/proxy.md, 'A proxy tier'; default %(default)s)")
    p.add_argument("--mode", choices=PROXY_MODES, default="push",
                   help="push: KVPathConnector; pull: vLLM NixlConnector; inproc-push: vLLM NixlPushConnector")
    p.add_argument("--prefill", action="append", required=True,
                   metavar="URL[,kv_addr=H:P,fabric_host=H,engine_id=ID,tp=N]",
                   help="a P instance, repeat for each; kv_addr: its connector's side channel (push) or NIXL side "
                        "channel (inproc-push), needed in both; fabric_host: its host in the fabric spec "
                        "(reservations); engine_id: its kv_transfer_config.engine_id (needed in inproc-push); "
                        "tp: its --tensor-parallel-size (optional: in push mode the proxy learns it from P's first "
                        "answer, sending that request's P leg before its D leg)")
    p.add_argument("--decode", action="append", required=True, metavar="URL[,fabric_host=H,engine_id=ID]",
                   help="engine_id: its connector's engine id (kv_connector_extra_config.engine_id, else "
                        "kv_transfer_config.engine_id); reservations then charge only the "
                        "worker pairs of the two engines (not every engine on the two hosts)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin",
                   help="how P and D instances are chosen: in turn, or fewest requests in flight, or (push mode "
                        "with a reservation service) P, D and the lane together by predicted TTFT (joint) or D and "
                        "the lane by the network with P by load (network); docs/placement.md (default %(default)s)")
    p.add_argument("--admin-token-file", metavar="PATH",
                   help=f"a file holding the admin token (else the {ADMIN_TOKEN_ENV} environment variable): enables "
                        "/admin/instances with 'Authorization: Bearer TOKEN' (without one they answer 403)")
    p.add_argument("--admin-token", metavar="TOKEN",
                   help="deprecated (every local user can read a command line): the admin token itself (for "
                        "/admin only; the reservation service's token is --reservation-token-file)")
    p.add_argument("--engine-api-key-file", metavar="PATH",
                   help="a file holding the engines' API key (vLLM's --api-key / VLLM_API_KEY), sent to them as "
                        "'Authorization: Bearer KEY' on both legs and GET /v1/models; without it the key comes from "
                        "$KVPATH_ENGINE_API_KEY, else $VLLM_API_KEY, else none is sent (never from the command line)")
    p.add_argument("--first-byte-timeout-s", type=float, default=300.0,
                   help="a leg with no first byte by then (a non-streamed answer: no answer) ends the request with 504")
    p.add_argument("--upstream-timeout-s", type=float, dest="first_byte_timeout_s", action=DeprecatedAlias,
                   new="--first-byte-timeout-s", help="deprecated alias of --first-byte-timeout-s")
    p.add_argument("--chunk-gap-timeout-s", type=float, default=60.0,
                   help="D's stream sending nothing for this long ends the client's stream with an error event")
    p.add_argument("--connect-timeout-s", type=float, default=15.0,
                   help="TCP connect to an engine; past it the request ends with 504")
    p.add_argument("--health-interval-s", type=float, default=2.0,
                   help="probe every instance's /health this often (0: no health checks)")
    p.add_argument("--health-timeout-s", type=float, default=5.0, help="a probe with no answer by then failed")
    p.add_argument("--unhealthy-after", type=int, default=2,
                   help="failures in a row (probes, or legs whose connection failed) that take an instance out "
                        "of rotation (one 200 from /health puts it back)")
    p.add_argument("--kv-bytes-per-token", type=int, default=131072, help="flow size estimate for reservations")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="a request body above this is refused with 413 (default 32 MiB)")
    p.add_argument("--reservation-url", help="a running `kvpath reservation` (push mode)")
    p.add_argument("--reservation-shard", action="append", default=[], metavar="FIRST-LAST=URL",
                   help="a `kvpath reservation` deciding for the pairs under leaves FIRST..LAST (repeat for each group "
                        "of leaves, instead of --reservation-url): a pair across groups is not reserved (cross_shard); "
                        "needs --fabric (docs/reservation.md, 'Past one process')")
    p.add_argument("--reservation", choices=("none", "inproc"), default="none",
                   help="inproc: run the reservation service inside the proxy (push mode); "
                        "its API is then at /reservation (connectors: reservation_url=http://PROXY/reservation)")
    p.add_argument("--reserve-at", choices=RESERVE_AT, default="admission",
                   help="admission: the proxy reserves each push's lane when it admits the request; push: it "
                        "does not, and P's connectors (reserve_at=push) reserve when the push starts")
    p.add_argument("--reservation-timeout-s", type=float, default=0.05,
                   help="past this, a request goes on the hash-chosen lane (counted as a fallback)")
    p.add_argument("--reservation-token-file", metavar="PATH",
                   help=f"a file holding the reservation service's token (else the {RESERVATION_TOKEN_ENV} environment "
                        "variable): sent to --reservation-url, and needed by every call to the service that "
                        "--reservation inproc mounts at /reservation but /health and /metrics (needed with either)")
    add_reservation_args(p, "--reservation-mode")
    p.set_defaults(func=cmd_proxy)
