"""Several proxy processes on one address (``kvpath proxy --workers N``): what they share.

uvicorn runs N worker processes on one listening socket; the kernel hands each new
connection to one of them. Each worker is a whole proxy (its own event loop, engine
connections and health probes) and they share:

- **the decisions**: one reservation service over HTTP (``--reservation-url``), so a
  lane or a placement is decided once for the whole tier, atomically (an in-process
  service per worker would decide the same free link N times);
- **the metrics**: prometheus-client's multiprocess mode (each worker writes its
  values to files in one directory; ``GET /metrics`` on any worker sums them), so one
  scrape sees the tier;
- **the instance set**: :class:`SharedInstances`, a file that ``/admin/instances``
  changes go through, under a lock, and that every worker follows.

What stays per worker: the in-flight counts that ``least_outstanding`` and the joint
placement read (each worker balances its own share of the requests), a learned TP
size, the health of an instance (each worker probes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from kvpath.proxy.instances import Instance, InstancePool

logger = logging.getLogger(__name__)

WORKER_ENV = "KVPATH_PROXY_WORKER"  # a worker's options as given (JSON; no secret read from a file), by the parent
RUN_DIR_ENV = "KVPATH_PROXY_RUN_DIR"  # the tier's private directory: the instance set, the metrics
METRICS_SUBDIR = "metrics"
FOLLOW_INTERVAL_S = 0.5
_FIELDS = ("url", "role", "fabric_host", "kv_addr", "engine_id")

T = TypeVar("T")


def _given(i: Instance) -> dict:
    """What the operator said of an instance (not what a worker learned or counted)."""
    return {**{k: getattr(i, k) for k in _FIELDS}, "tp_size": 0 if i.tp_learned else i.tp_size}


class SharedInstances:
    """The instance set of the tier, in ``<run dir>/instances.json``: a version and every
    instance as the operator gave it. A change (``change``) takes the file's lock, brings
    this worker's pools up to the file, applies itself, and writes the file with the next
    version; every worker reads a newer version within ``FOLLOW_INTERVAL_S``
    (``follow``). Small and rare (admin calls), so the lock and the file's I/O run on the
    event loop."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "instances.json"
        self._lock_path = Path(run_dir) / "instances.lock"
        self.version = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def publish(self, pools: dict[str, InstancePool]) -> None:
        """Write ``pools`` as the tier's set (the parent, before the workers start)."""
        with self._locked():
            self._write(pools, self._read()[0] + 1)

    def change(self, pools: dict[str, InstancePool], fn: Callable[[], T]) -> T:
        """Run ``fn`` (it changes ``pools``) on the tier's latest set, then share the result."""
        with self._locked():
            version, items = self._read()
            self._apply(pools, version, items)
            out = fn()
            # past every version seen: a file lost (a cleaned /tmp) must not go back in time
            self._write(pools, max(version, self.version) + 1)
            return out

    def sync(self, pools: dict[str, InstancePool]) -> bool:
        """Bring ``pools`` up to the tier's set; True when it changed them. Without the
        lock: the file is replaced whole (``os.replace``), so a read sees one version or
        the next, and a worker stalled holding the lock stalls no reader."""
        version, items = self._read()
        return self._apply(pools, version, items)

    async def follow(self, pools: dict[str, InstancePool], on_change: Callable[[], None] | None = None) -> None:
        """Keep ``pools`` at the tier's set (a background task of each worker)."""
        last = None
        while True:
            try:
                try:
                    st = self.path.stat()
                except FileNotFoundError:  # removed under us (a cleaned /tmp): the next change writes it
                    await asyncio.sleep(FOLLOW_INTERVAL_S)
                    continue
                # the inode too: every write is a new file, whatever the clock's tick
                if (st.st_ino, st.st_mtime_ns, st.st_size) != last:
                    last = (st.st_ino, st.st_mtime_ns, st.st_size)
                    if self.sync(pools) and on_change is not None:
                        on_change()
            except Exception:  # a bad write must not end following for good
                logger.exception("reading the tier's instance set %s failed", self.path)
            await asyncio.sleep(FOLLOW_INTERVAL_S)

    def _read(self) -> tuple[int, list[dict]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0, []
        return int(data["version"]), list(data["instances"])

    def _write(self, pools: dict[str, InstancePool], version: int) -> None:
        # bounded: each pool holds at most instances.MAX_INSTANCES
        items = [_given(i) for pool in pools.values() for i in pool.all()]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": version, "instances": items}))
        os.replace(tmp, self.path)  # readers see the old set or the new, never half of one
        self.version = version

    def _apply(self, pools: dict[str, InstancePool], version: int, items: list[dict]) -> bool:
        if version <= self.version:
            return False
        want = {(it["role"], it["url"]): it for it in items}
        for role, pool in pools.items():
            for inst in pool.all():
                if (role, inst.url) not in want:
                    pool.remove(inst.url)
        for (role, url), it in want.items():
            old = pools[role].get(url)
            if old is not None and _given(old) == it:
                continue  # unchanged: keep what this worker learned of it (its TP size)
            pools[role].add(Instance(**{k: it[k] for k in _FIELDS}, tp_size=it["tp_size"]))
        self.version = version
        logger.info("instance set version %d: %d prefill, %d decode", version, len(pools["prefill"].all()),
                    len(pools["decode"].all()))
        return True
