"""The ``ns3`` backend: packet-level TCP on the leaf-spine fabric, from the PyPI ns3 wheel.

``simulator_bridge/ns3/kvflows.cc`` is compiled with g++ against the wheel's headers
and libraries on first use and cached under ``~/.cache/kvpath/ns3`` (keyed by the
source, the ns-3 version, the flags and the libraries' path), because importing the Python bindings costs
~10 s and 0.7 GB per process. Each run writes the flows to a file, runs the binary
and reads one FCT per flow back.

The model (documented in docs/bridge-ns3.md): point-to-point links at the spec's rates with
a propagation delay per link, drop-tail queues at every egress port, TCP (Cubic by
default) with one connection per flow, or per ``FlowSpec.conn`` (a lane's flows share
its stream: written in turns of 64 KiB, a turn only while less than that is unsent in
the socket, as UCX interleaves a lane's WRITEs; done in the order they started, as ``FlowModel``
shares a connection; a flow on a lane idle past the minimum RTO
opens a new connection), segments of MTU - 52 bytes, and each flow
pinned to its spine by addressing (see the scenario's header comment). Queues are deep
and windows bounded by default (16 MiB queues, 1 MiB socket buffers): a lossless
approximation, the way a RoCE fabric with PFC carries KV traffic, which also keeps
ns-3's TCP out of the loss-recovery pathology measured here (flows stuck in repeated
RTOs for seconds under incast with shallow queues). Each run reports its drops.
With ``NetParams.burst_bytes`` > 0 every port is a token bucket at the link's rate in
front of a device ``line_x`` times faster, as the testbed's tbf-shaped links are.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kvpath.fabric import PORT_TIERS, FabricSpec
from kvpath.bridge.flow_model import FlowSpec, NetParams, fixed_costs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ns3") / "kvflows.cc"
NS3_LIBS = ("applications", "point-to-point", "internet", "traffic-control", "network", "core")
CXXFLAGS = ("-std=c++20", "-O2", "-w")


class Ns3Error(RuntimeError):
    pass


@dataclass(frozen=True)
class Ns3Params:
    """The transport and queue model (the testbed's TCP variant is Cubic)."""

    tcp: str = "TcpCubic"
    mtu: int | None = None  # None: the fabric spec's; larger = coarser segments, fewer packets
    queue_bytes: int = 16 << 20  # drop-tail queue of every egress port
    buf_bytes: int = 1 << 20  # TCP send and receive buffers: bound each flow's window
    delay_us: float = 1.0  # propagation delay per link
    min_rto_ms: float | None = None  # None: auto_min_rto_ms (a floor well above the base RTT)
    line_x: float = 100.0  # with a token bucket: the device rate over the link rate (the burst's speed)
    horizon_s: float = 3600.0  # simulated time after the last start before giving up
    timeout_s: float | None = None  # wall-clock limit of one run
    # a host's own egress port holds all its sockets can send (never drops), as the
    # testbed's did on every suite run; False: queue_bytes like every other port
    lossless_host: bool = True
    # a host's own port serves its connections in turn (Linux's TCP small queues keep
    # about 1 ms of each socket's data in the qdisc, so sockets interleave); False: the
    # first to fill the queue is served first
    fair_host: bool = True

    def __post_init__(self) -> None:
        if self.mtu is not None and not 576 <= self.mtu <= 65535:
            raise ValueError(f"ns3 mtu must be in [576, 65535], got {self.mtu}")
        if self.queue_bytes >= (1 << 32) - (1 << 16):
            raise ValueError(f"ns3 queue_bytes must be below 4 GiB (a queue disc's size is 32 bits), got {self.queue_bytes}")
        if self.queue_bytes < 1500 or self.buf_bytes < 1500 or self.delay_us < 0 or (
                self.min_rto_ms is not None and self.min_rto_ms <= 0) or self.line_x < 1:
            raise ValueError("ns3 queue_bytes and buf_bytes must be >= 1500, delay_us >= 0, min_rto_ms > 0, "
                             "line_x >= 1")


def auto_min_rto_ms(spec: FabricSpec, mtu: int, delay_us: float) -> float:
    """ns-3's RTO floor: 5 ms, or 10x the base RTT of one full segment where that is
    longer. A coarse segment on a slow (scaled) link takes milliseconds per hop, and
    with a floor below the RTT ns-3 retransmits without any loss (measured: a lone
    flow 5.9x its line-rate time at 0.2 Gbit/s with 64 KB segments and a 5 ms floor)."""
    gbps = min(spec.host_link_gbps, spec.spine_link_gbps)
    hop_s = mtu * 8 / (gbps * 1e9) + delay_us * 1e-6
    return max(5.0, 10 * 8 * hop_s * 1e3)  # 4 hops out and 4 back


def ns3_root() -> Path:
    """The wheel's install directory (headers in include/, libraries in lib64/)."""
    root = Path(sysconfig.get_paths()["purelib"]) / "ns3"
    if not (root / "include" / "ns3").is_dir() or not (root / "lib64").is_dir():
        raise Ns3Error("the ns3 backend needs the PyPI ns3 wheel: pip install -r requirements/bridge.txt")
    return root


def _version(root: Path) -> str:
    libs = sorted(p.name for p in (root / "lib64").glob("libns3*-core*.so"))
    if not libs:
        raise Ns3Error(f"no libns3*-core*.so in {root / 'lib64'}: a broken ns3 install")
    return libs[0].removeprefix("lib").split("-core")[0]  # "ns3.44"


def binary(cache_dir: Path | None = None) -> Path:
    """The compiled scenario, built on first use (~10-20 s) and cached; concurrent
    callers (a parallel sweep) wait on a lock instead of compiling twice."""
    root = ns3_root()
    ver = _version(root)
    lib = (root / "lib64").resolve()
    # the binary finds the libraries by the path it was linked against (its rpath), so the
    # path is part of the key: a binary linked against another checkout's deleted venv
    # would otherwise be reused and fail to start
    key = hashlib.sha256(SOURCE.read_bytes() + ver.encode() + " ".join(CXXFLAGS).encode()
                         + os.fsencode(lib)).hexdigest()[:16]
    cache = cache_dir or Path(os.environ.get("KVPATH_CACHE", Path.home() / ".cache" / "kvpath")) / "ns3"
    cache.mkdir(parents=True, exist_ok=True)
    exe = cache / f"kvflows-{ver}-{key}"
    if exe.exists():
        return exe
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise Ns3Error("the ns3 backend compiles a C++ scenario on first use: install g++ (apt-get install g++)")
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        _prune(cache)
        log.info("compiling the ns-3 scenario against %s in %s (once)", ver, lib)
        tmp = exe.parent / f"{exe.name}.tmp"
        cmd = [cxx, *CXXFLAGS, f"-I{root / 'include'}", "-o", str(tmp), str(SOURCE), f"-L{lib}",
               f"-Wl,-rpath,{lib}", *(f"-l{ver}-{m}" for m in NS3_LIBS)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise Ns3Error(f"compiling {SOURCE.name} failed:\n{r.stderr[-4000:]}")
        _sidecar(exe).write_bytes(os.fsencode(lib))
        tmp.rename(exe)
    return exe


LIB_SUFFIX = ".lib"  # beside each cached binary: the library directory it was linked against


def _sidecar(exe: Path) -> Path:
    return exe.with_name(exe.name + LIB_SUFFIX)


def _prune(cache: Path) -> None:
    """Deletes cached binaries whose libraries are gone (their venv was deleted) and the
    partial output of killed compiles, so a cache shared by many checkouts stays bounded
    by the live ones. Housekeeping only: an entry it cannot read or delete is left as it is."""
    now = time.time()
    for side in cache.glob(f"kvflows-*{LIB_SUFFIX}"):
        try:
            if not side.is_file() or Path(os.fsdecode(side.read_bytes().strip())).is_dir():
                continue
            side.with_name(side.name.removesuffix(LIB_SUFFIX)).unlink(missing_ok=True)
            side.unlink(missing_ok=True)
        except (OSError, UnicodeError):
            continue
    for exe in cache.glob("kvflows-*"):
        try:
            if exe.suffix == ".tmp":
                # a compile's output before its rename: one killed mid-way leaves it. Compiles
                # run under the lock we hold, and take seconds: an hour-old one is nobody's
                if exe.is_file() and exe.stat().st_mtime < now - 3600:
                    exe.unlink()
            # built before sidecars (or by an older checkout sharing the cache, which may be
            # about to run it): its libraries are unknown, so only a day after it was built
            elif (exe.suffix != LIB_SUFFIX and exe.is_file()
                    and not _sidecar(exe).exists() and exe.stat().st_mtime < now - 86400):
                exe.unlink()
        except OSError:
            continue


@dataclass
class Ns3Result:
    fct_s: np.ndarray
    drops: int  # packets dropped at any egress queue
    wall_s: float
    uplink_bytes: dict[tuple[int, int], int]  # (leaf, spine) -> bytes sent up, headers included
    # packets dropped per tier of egress port: host_up (a host's port to its leaf),
    # leaf_down, leaf_up (to a spine), spine_down
    tier_drops: dict[str, int] = field(default_factory=dict)


class Ns3Backend:
    """Replays flows, each on its spine, in ns-3; FCTs in seconds (+ ``flow_model.fixed_costs``).

    Of :class:`NetParams`, ``overhead_s``, ``cold_s`` and ``burst_bytes`` apply (a token bucket
    per port; it must hold a packet, so it exceeds the MTU); ns-3 models the headers
    and the transport itself, so ``efficiency`` does not."""

    def __init__(self, spec: FabricSpec, net: NetParams | None = None, params: Ns3Params | None = None):
        self.spec = spec
        self.net = net or NetParams()
        self.params = params or Ns3Params()
        if spec.leaves > 255 or spec.hosts_per_leaf > 254 or spec.spines > 254:
            raise ValueError("the ns3 backend addresses at most 255 leaves, 254 spines and 254 hosts per leaf")

    def run(self, flows: list[FlowSpec], progress: Callable[[int, int], None] | None = None) -> Ns3Result:
        n = len(flows)
        fct = np.zeros(n)
        t0 = time.perf_counter()
        hpl = self.spec.hosts_per_leaf
        lines = []
        for i, f in enumerate(flows):
            sl, sh = self.spec.locate(f.src)
            dl, dh = self.spec.locate(f.dst)
            src, dst = sl * hpl + sh, dl * hpl + dh
            if src == dst or int(f.bytes) <= 0:
                continue  # nothing crosses a link: FCT 0, as in the flow model
            spine = -1 if sl == dl else f.spine
            if spine is None or not -1 <= spine < self.spec.spines:
                raise ValueError(f"flow {i} ({f.src} -> {f.dst}) crosses the spines: give its spine")
            conn = -1 if f.conn is None else int(f.conn)  # one lane's flows share a connection in ns-3 too
            lines.append(f"{i} {src} {dst} {spine} {int(f.bytes)} {f.start_s!r} {conn}\n")
        if not lines:
            return Ns3Result(fct + fixed_costs(flows, self.net), 0, time.perf_counter() - t0, {}, dict.fromkeys(PORT_TIERS, 0))
        p = self.params
        mtu = p.mtu or self.spec.mtu
        burst = self.net.burst_bytes
        if 0 < burst <= mtu:
            raise ValueError(f"burst_bytes {burst} must exceed the ns3 MTU {mtu}: a token bucket holds a packet")
        exe = binary()
        min_rto = p.min_rto_ms if p.min_rto_ms is not None else auto_min_rto_ms(self.spec, mtu, p.delay_us)
        with tempfile.TemporaryDirectory(prefix="kvpath-ns3-") as tmp:
            fin, fout = Path(tmp) / "flows.txt", Path(tmp) / "fct.txt"
            fin.write_text("".join(lines))
            cmd = [str(exe), f"--flows={fin}", f"--out={fout}", f"--leaves={self.spec.leaves}",
                   f"--spines={self.spec.spines}", f"--hostsPerLeaf={hpl}",
                   f"--hostGbps={self.spec.host_link_gbps!r}", f"--spineGbps={self.spec.spine_link_gbps!r}",
                   f"--mtu={mtu}", f"--delayUs={p.delay_us!r}", f"--queueBytes={p.queue_bytes}",
                   f"--bufBytes={p.buf_bytes}", f"--minRtoMs={min_rto!r}", f"--tcp={p.tcp}",
                   f"--horizonS={p.horizon_s!r}", f"--burstBytes={burst}", f"--lineX={p.line_x!r}",
                   f"--losslessHost={int(p.lossless_host)}", f"--fairHost={int(p.fair_host)}"]
            if progress is None and sys.stderr.isatty():
                # a run can take minutes: show ns-3's own completion count on a terminal
                from rich.progress import Progress

                with Progress(transient=True) as bar:
                    task = bar.add_task("ns-3", total=len(lines))
                    drops, uplinks, tiers, err, failed = self._execute(
                        cmd, len(lines), lambda d, _: bar.update(task, completed=d))
            else:
                drops, uplinks, tiers, err, failed = self._execute(cmd, len(lines), progress)
            got = np.loadtxt(fout, ndmin=2) if fout.exists() else np.zeros((0, 2))
        if got.shape[0] != len(lines):
            raise Ns3Error(f"ns-3 returned {got.shape[0]} of {len(lines)} flows: {err[-2000:]}")
        ids, vals = got[:, 0].astype(np.int64), got[:, 1]
        if (vals < 0).any():
            why = f"; ns-3's TCP gave up on {failed} connections (every retry unanswered)" if failed else ""
            raise Ns3Error(f"{int((vals < 0).sum())} flows did not finish within horizon_s={p.horizon_s} "
                           f"of simulated time ({drops} drops){why}")
        fct[ids] = vals
        return Ns3Result(fct + fixed_costs(flows, self.net), drops, time.perf_counter() - t0, uplinks, tiers)

    def _execute(self, cmd: list[str], n: int,
                 progress: Callable[[int, int], None] | None
                 ) -> tuple[int, dict[tuple[int, int], int], dict[str, int], str, int]:
        """Runs the scenario: (drops, bytes per uplink, drops per tier, stderr's other lines,
        connections ns-3's TCP gave up on)."""
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        drops, failed, tail, uplinks, tiers = 0, 0, [], {}, {}
        assert proc.stderr is not None
        # the progress lines block the reader, so the wall-clock limit is a timer that kills
        timer = threading.Timer(self.params.timeout_s, proc.kill) if self.params.timeout_s else None
        if timer:
            timer.start()
        try:
            for line in proc.stderr:
                if line.startswith("progress "):
                    if progress:
                        progress(int(line.split()[1]), n)
                elif line.startswith("stats drops "):
                    drops = int(line.split()[2])
                elif line.startswith("stats conn_failed "):
                    failed = int(line.split()[2])
                elif line.startswith("stats uplink "):
                    _, _, leaf, spine, nbytes = line.split()
                    uplinks[(int(leaf), int(spine))] = int(nbytes)
                elif line.startswith("stats tier_drops "):
                    parts = line.split()
                    if len(parts) != 4 or parts[2] not in PORT_TIERS or not parts[3].isdigit():
                        raise Ns3Error(f"ns-3 wrote a malformed line: {line.strip()[:200]}")
                    tiers[parts[2]] = int(parts[3])
                elif line.startswith("stats host_queue_clamped "):
                    log.warning("ns-3: a host's port holds less than its connections' buffers and may drop: %s",
                                line.strip()[:200])
                else:
                    tail.append(line)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if timer and rc < 0:
            raise Ns3Error(f"ns-3 run exceeded timeout_s={self.params.timeout_s} and was stopped")
        if rc != 0:
            raise Ns3Error(f"ns-3 exited with {rc}: {''.join(tail)[-2000:]}")
        if set(tiers) != set(PORT_TIERS):
            raise Ns3Error(f"ns-3 reported drops for tiers {sorted(tiers)}, not {list(PORT_TIERS)}")
        if drops:  # expected where the queues are the testbed's own (its drops are the trace's)
            log.info("ns-3 dropped %d packets at its %d-byte drop-tail egress queues", drops, self.params.queue_bytes)
        return drops, uplinks, tiers, "".join(tail), failed

