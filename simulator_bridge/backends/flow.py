"""``flow``: the max-min fair flow-level model (``flow_model.FlowModel``), closed loop in
the serving simulation (the reservation code runs on its clock)."""

from __future__ import annotations

from kvpath.bridge.backends.base import LaneHooks, NetworkBackend, Replay, register
from kvpath.bridge.flow_model import FlowModel, FlowSpec


@register
class FlowBackend(NetworkBackend):
    name = "flow"
    closed_loop = True

    def replay(self, flows: list[FlowSpec]) -> Replay:
        return Replay(FlowModel(self.spec, self.net).run(flows))

    def serve(self, flows: list[FlowSpec], hooks: LaneHooks) -> Replay:
        return Replay(FlowModel(self.spec, self.net).run(flows, decide=hooks.decide, decide_at=hooks.decide_at,
                                                         on_end=hooks.on_end, gate=hooks.gate, waited=hooks.waited))
