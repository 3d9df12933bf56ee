"""``kvpath reservation``: the path reservation service over HTTP, and the options the
proxy shares with it to run one in process (``--reservation inproc``)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from kvpath.credentials import secret_arg
from kvpath.fabric import FabricSpec, FabricSpecError
from kvpath.reservation.decisions import ReservationError, ReservationService
from kvpath.reservation.wire import METRICS, MODES as RES_MODES, TOKEN_ENV as RESERVATION_TOKEN_ENV

if TYPE_CHECKING:
    from kvpath.placement import CostModel

logger = logging.getLogger(__name__)


def load_fabric(path: str | None) -> FabricSpec:
    try:
        return FabricSpec.resolve(path) if path else FabricSpec()
    except FabricSpecError as e:
        raise SystemExit(f"kvpath: error: --fabric: {e}") from None


def add_reservation_args(p: argparse.ArgumentParser, mode_flag: str = "--mode") -> None:
    p.add_argument("--fabric", help="fabric preset (small, rack3, rack4, rack4-os2, rack8) or spec file, JSON or YAML "
                                    "(default: 4 leaves x 4 spines x 4 hosts)")
    p.add_argument("--kernel-oracle", metavar="NETNS_PREFIX", default="",
                   help="ask a running testbed's kernel which spine a lane takes (its namespaces are named "
                        "NETNS_PREFIX-<node>, e.g. kvp-ab12) instead of the fabric model's hash")
    p.add_argument(mode_flag, dest="res_mode", choices=RES_MODES, default="cc", help="reservation decision mode")
    p.add_argument("--lease-s", type=float, default=10.0, help="a reservation ends after this without a release")
    p.add_argument("--dc-delay-s", type=float, default=0.0, help="dc mode: broadcast delay between agents")
    p.add_argument("--cc-metric", choices=METRICS, default="flows",
                   help="cc/dc: least reserved flows on a path's busiest link, or least reserved bytes")
    p.add_argument("--lanes-ttl-s", type=float, default=900.0,
                   help="forget a worker pair's lanes not registered again for this long (P re-registers each minute)")
    p.add_argument("--placement-model", default="llama-3-8b",
                   help="joint placement (/v1/place): the model whose iteration times cost P's queue, the prefill and "
                        "D's admission (a preset of kvpath/models.py)")
    p.add_argument("--placement-accelerator", default="h100", help="joint placement: the accelerator preset")
    p.add_argument("--placement-time-scale", type=float, default=1.0,
                   help="joint placement: compute times multiplied by this (the testbed's B/S)")
    p.add_argument("--placement-max-batch-tokens", type=int, default=8192,
                   help="joint placement: P's prefill tokens per iteration")
    p.add_argument("--placement-push-granularity", choices=("request", "layer"), default="request",
                   help="joint placement: P's connectors push after the prefill, or layer by layer (only what the "
                        "overlap leaves is costed)")
    p.add_argument("--placement-layer-group", type=int, default=4, help="joint placement: layers per layer-wise WRITE")


def build_cost(args: argparse.Namespace, spec: FabricSpec) -> "CostModel":
    """The placement's cost model from the options above; a bad one stops with the flag's name."""
    from kvpath.iteration_time import IterationTimeModel, ModelSpecError
    from kvpath.placement import CostModel, PlacementError

    try:
        itm = IterationTimeModel.preset(args.placement_model, args.placement_accelerator)
    except (ModelSpecError, KeyError, ValueError) as e:
        raise SystemExit(f"kvpath: error: --placement-model/--placement-accelerator: {e}") from None
    try:
        return CostModel(spec, itm, max_batch_tokens=args.placement_max_batch_tokens,
                         time_scale=args.placement_time_scale, granularity=args.placement_push_granularity,
                         layer_group=args.placement_layer_group)
    except PlacementError as e:
        raise SystemExit(f"kvpath: error: --placement-*: {e}") from None


def build_service(fabric: str | None, mode: str, lease_s: float, dc_delay_s: float,
                  kernel_oracle: str = "", metric: str = "flows", lanes_ttl_s: float = 900.0) -> ReservationService:
    spec = load_fabric(fabric)
    oracle = None
    if kernel_oracle:
        from kvpath.oracle import KernelOracle

        oracle = KernelOracle.for_prefix(spec, kernel_oracle)
    try:
        return ReservationService(spec, mode, lease_s=lease_s, dc_delay_s=dc_delay_s, oracle=oracle, metric=metric,
                                  lanes_ttl_s=lanes_ttl_s)
    except ReservationError as e:
        raise SystemExit(f"kvpath: error: {e}") from None


def cmd_reservation(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpath.reservation.app import create_app
    from kvpath.web.heap import freeze_startup_heap

    token = secret_arg(args, "reservation", "--token-file", RESERVATION_TOKEN_ENV, "--admin-token")
    if not token:
        raise SystemExit(f"kvpath reservation: error: no token: give --token-file PATH (a file holding it) or set "
                         f"{RESERVATION_TOKEN_ENV}; every call but /health and /metrics needs it, and the proxy and "
                         f"P's connectors send it (docs/reservation.md)")
    svc = build_service(args.fabric, args.res_mode, args.lease_s, args.dc_delay_s, args.kernel_oracle, args.cc_metric,
                        args.lanes_ttl_s)
    logger.info("reservation service: mode %s on %s:%d", svc.mode, args.host, args.port)
    app = create_app(svc, token=token, cost=build_cost(args, svc.spec))
    freeze_startup_heap()  # built: the app, the service, every module (kvpath/web/heap.py)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("reservation", help="the path reservation service (FastAPI)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    r.add_argument("--port", type=int, default=8900, help="TCP port to listen on (default %(default)s)")
    r.add_argument("--token-file", metavar="PATH",
                   help=f"a file holding the service's token (else the {RESERVATION_TOKEN_ENV} environment variable; "
                        "one of the two is needed): every call but /health and /metrics needs "
                        "'Authorization: Bearer TOKEN'")
    r.add_argument("--admin-token", metavar="TOKEN",
                   help="deprecated (every local user can read a command line): the token itself")
    add_reservation_args(r)
    r.set_defaults(func=cmd_reservation)
