"""Which engines a run starts: the one place that maps ``RunConfig.engine`` to its
:class:`~kvpath.testbed.engines.Engines` (the base module, which both kinds import,
names neither)."""

from __future__ import annotations

from kvpath.testbed.engines import Engines, RunSite


def engines_for(site: RunSite) -> Engines:
    # imported on use: an emulated run never loads the vLLM engines' module, nor the reverse
    if site.cfg.engine == "vllm":
        from kvpath.testbed.vllm_engines import VllmEngines

        return VllmEngines(site)
    from kvpath.testbed.emulated_engines import EmulatedEngines

    return EmulatedEngines(site)
