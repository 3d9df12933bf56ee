"""The P and D engines of a testbed run, one kind per run, chosen once from its configuration.

Both kinds (:class:`~kvpath.testbed.emulated_engines.EmulatedEngines`,
:class:`~kvpath.testbed.vllm_engines.VllmEngines`) serve OpenAI-style completions on the
management network and move KV on the fabric; the orchestrator drives them through the
:class:`Engines` protocol and never asks which kind it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.testbed.netns_fabric import NetnsFabric
from kvpath.testbed.run_config import RunConfig

API_PORT = 8000  # every engine's HTTP port, on its management address
KV_PORT = KV_SIDE_CHANNEL_PORT  # P's KV side channel, on its fabric address


def engine_id(role: str, host: str) -> str:
    """``p-l0h0``, ``d-l1h0``: the engine's name in the proxy's flags and the connector's records."""
    return f"{role[0]}-{host}"


@dataclass(frozen=True)
class RunSite:
    """Where a run's engines live: its fabric, the hosts of each pool and its folder."""

    fabric: NetnsFabric
    cfg: RunConfig
    p_hosts: list[str]
    d_hosts: list[str]
    spec_file: Path  # the fabric's spec, for the connector's and the proxy's path oracle
    out: Path

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def roles(self) -> list[tuple[str, str]]:
        """(role, host) of every engine, P first."""
        return [("prefill", h) for h in self.p_hosts] + [("decode", h) for h in self.d_hosts]

    @property
    def pairs(self) -> int:
        return len(self.p_hosts) * len(self.d_hosts)

    def url(self, host: str) -> str:
        return f"http://{self.fabric.mgmt_ip(host)}:{API_PORT}"

    def transfer_trace(self, host: str) -> Path:
        """The connector's transfer records of the engine on ``host`` (either kind writes them)."""
        return self.out / f"transfers-{host}.jsonl"

    @property
    def token_file(self) -> Path:
        """The run's token for the reservation service the proxy mounts, in a 0600 file
        made on first use: the proxy reads it (--reservation-token-file), P connectors too
        (reservation_token_file). Processes get the file's path, never the token on argv."""
        path = self.out / "keys" / "admin-token"
        if not path.exists():
            import secrets

            from kvpath.credentials import write_secret_file

            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_secret_file(path, secrets.token_urlsafe(24))
        return path

    @property
    def admin_token(self) -> str:
        """The token in :attr:`token_file` (what this process sends to read the service)."""
        from kvpath.credentials import read_secret_file

        return read_secret_file(self.token_file, "the run's reservation token")

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def control_keys(self, role: str) -> dict[str, str]:
        """The connector's control-channel key knobs for ``role`` ("prefill"/"decode"):
        a prefill and a decode key pair made for this run (in its folder), each
        trusting the other."""
        from kvpath.connector.control_auth import pd_key_knobs

        return pd_key_knobs(self.out / "keys", role)

    def engine_log(self, role: str, host: str) -> Path:
        return self.logs / f"{role}-{host}.log"

    def proxy_instance_args(self) -> list[str]:
        """The proxy's ``--prefill``/``--decode`` flags for every engine. With a push
        connector the proxy also needs P's KV address and engine id (D registers there),
        and with KVPathConnector D's engine id (reservations then charge the two engines'
        worker pairs only)."""
        spec = self.fabric.spec
        argv: list[str] = []
        for role, h in self.roles:
            if role == "decode":
                argv += ["--decode", f"{self.url(h)},fabric_host={h}"
                                     + (f",engine_id={engine_id(role, h)}" if self.cfg.pushes else "")]
            elif self.cfg.pushes or self.cfg.connector == "nixl-push":  # D's leg names P's side channel and id
                p_tp, d_tp = self.cfg.tp_sizes
                argv += ["--prefill", f"{self.url(h)},kv_addr={spec.host_ip(h)}:{KV_PORT},fabric_host={h},"
                                      f"engine_id={engine_id(role, h)}" + (f",tp={p_tp}" if p_tp != d_tp else "")]
            else:
                argv += ["--prefill", f"{self.url(h)},fabric_host={h}"]
        return argv


class Engines(Protocol):
    """What a run needs of its engines."""

    site: RunSite
    model_name: str  # what requests name as their model

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token's prefill leaves to push (what the reservation service counts)."""
        ...

    def start(self, proxy_url: str) -> None:
        """Start every engine in its host's namespace and wait until each answers."""
        ...

    def warm_up(self, proxy_url: str, console: Console) -> None:
        """Open every P-D pair's connections before the measured run (and, with a push
        connector, register its lanes with the reservation service)."""
        ...

    def settle(self, client: list[dict[str, Any]]) -> None:
        """Wait until every push of the run has ended and been recorded."""
        ...

    def records(self) -> dict[str, dict[str, Any]]:
        """Per engine host: ``{"role", "records": [{transfer_id, prefill_end | kv_ready, ...}], "kv_usage"}``."""
        ...

    def decode_only(self, client: list[dict[str, Any]], workload: Any) -> dict[str, Any] | None:
        """The P/D outputs against P alone on the same prompts (the driver's); None where
        outputs are not real."""
        ...

    def kv_loss(self) -> dict[str, int] | None:
        """The engines' own count of lost KV transfers; None where they keep none."""
        ...

    def stop(self) -> None:
        ...
