"""``ns3``: packet-level TCP in ns-3 (``ns3_backend.Ns3Backend``), with its own parameters
(``Ns3Params``). The reservation code cannot call into a running ns-3, so in the serving
simulation the lanes are decided on the flow model's clock and ns-3 replays them once
(docs/bridge-serving.md); it counts the packets its queues drop."""

from __future__ import annotations

from kvpath.bridge.backends.base import NetworkBackend, Replay, register
from kvpath.bridge.flow_model import FlowSpec
from kvpath.bridge.ns3_backend import Ns3Backend, Ns3Params


@register
class Ns3NetworkBackend(NetworkBackend):
    name = "ns3"
    lanes_by = "flow"
    counts_drops = True
    fits_efficiency = False  # ns-3 models headers and TCP itself
    options_type = Ns3Params

    def replay(self, flows: list[FlowSpec]) -> Replay:
        res = Ns3Backend(self.spec, self.net, self.options).run(flows)
        return Replay(res.fct_s, res.drops, res.tier_drops, {"ns3_drops": res.drops, "ns3_wall_s": res.wall_s})

    def packet_bytes(self) -> int:
        return (self.options.mtu if self.options else None) or self.spec.mtu
