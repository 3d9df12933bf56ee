"""Health checks: instances whose ``/health`` fails leave rotation until it answers 200.

A background task probes every instance of both pools every ``interval_s``. After
``unhealthy_after`` failures in a row an instance is marked unhealthy, and
``InstancePool.pick`` skips it; one 200 from ``/health`` puts it back. The proxy
also reports a leg whose connection failed (refused, reset, closed mid-answer) as a
failed probe, so a dead engine leaves rotation after a request or two rather than
after a probe cycle. Timeouts are not reported: a busy engine is slow, not dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import aiohttp

from kvpath.proxy.instances import Instance, InstancePool

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, pools: dict[str, InstancePool], interval_s: float, timeout_s: float, unhealthy_after: int,
                 on_round: Callable[[], None] | None = None):
        self.pools = pools
        self.on_round = on_round  # called after every probe round (the proxy's gauges)
        self.interval_s = interval_s  # 0: no health checking at all
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.unhealthy_after = unhealthy_after
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def start(self, session: aiohttp.ClientSession) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._run(session), name="kvpath-proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            # sleep first: instances start in rotation, and a probe racing start-up tells nothing new
            await asyncio.sleep(self.interval_s)
            insts = [i for pool in self.pools.values() for i in pool.all()]
            try:
                await asyncio.gather(*(self.probe(session, i) for i in insts))
                if self.on_round is not None:
                    self.on_round()
            except Exception:  # a bug here must not end health checking for good
                logger.exception("health probe round failed")

    async def probe(self, session: aiohttp.ClientSession, inst: Instance) -> None:
        try:
            async with session.get(inst.url + "/health", timeout=self.timeout) as r:
                await r.read()
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ok, why = False, f"/health failed: {e!r}"
        if ok:
            self._passed(inst)
        else:
            self.failed(inst, why)

    def failed(self, inst: Instance, why: str) -> None:
        """One failed probe (or failed leg connection) of ``inst``."""
        if not self.enabled:
            return  # nothing would ever put it back
        inst.health_failures += 1
        if inst.healthy and inst.health_failures >= self.unhealthy_after:
            inst.healthy = False
            logger.warning("%s %s out of rotation after %d failures in a row (last: %s)",
                           inst.role, inst.url, inst.health_failures, why)

    def _passed(self, inst: Instance) -> None:
        inst.health_failures = 0
        if not inst.healthy:
            inst.healthy = True
            logger.info("%s %s answers /health again: back in rotation", inst.role, inst.url)
