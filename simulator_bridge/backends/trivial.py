"""``trivial``: each flow alone, bytes over its path's slowest link (``flow_model.trivial_fct``);
flows never meet, so in the serving simulation a lane is released as soon as it is decided."""

from __future__ import annotations

from kvpath.bridge.backends.base import NetworkBackend, Replay, register
from kvpath.bridge.flow_model import FlowSpec, trivial_fct


@register
class TrivialBackend(NetworkBackend):
    name = "trivial"

    def replay(self, flows: list[FlowSpec]) -> Replay:
        return Replay(trivial_fct(self.spec, flows, self.net))
