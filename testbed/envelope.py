"""The fidelity envelope: did this run measure the system, or this machine? Pure
functions over runs' summaries (``summary.json``), no I/O.

``run_report.fidelity`` checks what one run sees of itself (CPU saturated, a lone flow
off the link rate, spine counters off the pushed bytes). A run that shared the machine
with a light load passes those and still reads slow: its pushes' fixed cost and its
decode steps stretch while the CPU is far from saturated. The envelope judges a run
against what it needs and against its peers (the other runs of the same invocation:
every variant and repeat runs the same workload on the same fabric):

- per-push overhead (``push_overhead_s``: lone pushes' median FCT minus wire time,
  testbed seconds) above an absolute bound, or far above the peers' median;
- TPOT against the iteration-time model (emulated engines sleep the model's decode step
  x B/S, so measured / modelled above 1 is the event loop running late) above an
  absolute bound, or far above the peers' median ratio;
- CPU idle median far below the peers' median.

The bounds and the measurements that chose them are in docs/testbed-fidelity.md ("The
fidelity envelope").
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

# The bounds, each from runs on this 2-core machine (docs/testbed-fidelity.md, "The
# fidelity envelope", has the table). Per-push overhead, testbed seconds: quiet runs 2.1-2.6 ms
# (21 demo runs, quick and full) and 2.8-3.1 ms (the filed full runs); the disturbed run
# of the issue 12.5 ms. No quiet run came near 8 ms; 2x the peers' median leaves ten
# times the widest quiet spread (a run at 1.09x its peers' median). The absolute bound
# holds for emulated engines, on which it was measured.
OVERHEAD_MAX_S = 0.008
OVERHEAD_OVER_PEERS = 2.0
MIN_LONE_PUSHES = 5  # fewer lone pushes: run_report leaves the overhead at 0 (not measured)
# Measured mean TPOT (datacenter) / the model's at batch one: quiet 1.005-1.013 (21 runs;
# 0.995-1.006 of their peers' median),
# the disturbed run 9.5 / 8.06 = 1.18 against 1.02 for its peers. Batching adds
# to it legitimately (every running sequence's KV is read: 8P8D at 28 QPS read 1.08),
# hence the loose absolute bound and the tight one against peers at the same load.
TPOT_RATIO_MAX = 1.25
TPOT_OVER_PEERS = 1.05
# CPU idle median (%) under this share of the peers' median: quiet runs 0.98-1.03 of
# their peers' (where no peer was disturbed), runs beside a one-core busy loop 0.40-0.47, the issue's 35% against 74%
# 0.47. Only judged when the peers had room to spare (at low idle the runs saturate
# alike and run_report's 10% floor applies).
IDLE_UNDER_PEERS = 0.6
IDLE_PEERS_MIN = 20.0


def overhead(s: dict[str, Any]) -> float | None:
    """The run's per-push overhead in testbed seconds, None when too few pushes ran alone
    to measure it."""
    if (s.get("lone_pushes") or 0) < MIN_LONE_PUSHES:
        return None
    return s.get("push_overhead_s")


def tpot_ratio(s: dict[str, Any]) -> float | None:
    """Measured mean TPOT (datacenter-equivalent) over the model's; None with real
    engines or no decode."""
    model = s.get("tpot_model_s")
    meas = (s.get("datacenter") or {}).get("tpot_s", {}).get("mean")
    return meas / model if model and meas else None


def cpu_idle(s: dict[str, Any]) -> float | None:
    return (s.get("fidelity") or {}).get("cpu_idle_median")


def _peer_median(values: Sequence[float | None], i: int, kinds: Sequence[tuple[Any, Any]]) -> float | None:
    """The median of the other runs of the same engines and connector: real engines under
    another connector (vLLM's in-tree ones spin a core) legitimately use other CPU."""
    others = [v for k, v in enumerate(values) if k != i and v is not None and kinds[k] == kinds[i]]
    return statistics.median(others) if others else None


def judge(summaries: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Each run's envelope problems (empty: inside), judged alone and against the others
    in ``summaries`` (one invocation's runs: same workload and fabric)."""
    ovh = [overhead(s) for s in summaries]
    tpr = [tpot_ratio(s) for s in summaries]
    idle = [cpu_idle(s) for s in summaries]
    kinds = [(s.get("engine"), s.get("connector")) for s in summaries]
    out = []
    for i in range(len(summaries)):
        problems = []
        o, po = ovh[i], _peer_median(ovh, i, kinds)
        if o is not None and o > OVERHEAD_MAX_S and summaries[i].get("engine") == "emulated":
            problems.append(f"per-push overhead {o * 1e3:.1f} ms > {OVERHEAD_MAX_S * 1e3:.0f} ms")
        elif o is not None and po and o > OVERHEAD_OVER_PEERS * po:
            problems.append(f"per-push overhead {o * 1e3:.1f} ms > {OVERHEAD_OVER_PEERS:g} x the other runs' "
                            f"median {po * 1e3:.1f} ms")
        t, pt = tpr[i], _peer_median(tpr, i, kinds)
        if t is not None and t > TPOT_RATIO_MAX:
            problems.append(f"TPOT {t:.2f} x the iteration-time model's > {TPOT_RATIO_MAX:g}")
        elif t is not None and pt and t > TPOT_OVER_PEERS * pt:
            problems.append(f"TPOT {t:.2f} x the model's > {TPOT_OVER_PEERS:g} x the other runs' median {pt:.2f}")
        c, pc = idle[i], _peer_median(idle, i, kinds)
        if c is not None and pc is not None and pc >= IDLE_PEERS_MIN and c < IDLE_UNDER_PEERS * pc:
            problems.append(f"CPU idle median {c:.0f}% < {IDLE_UNDER_PEERS:g} x the other runs' median {pc:.0f}%")
        out.append(problems)
    return out


def apply(summaries: Sequence[dict[str, Any]]) -> None:
    """Adds each run's envelope verdict to its ``fidelity`` (``envelope`` with the
    values judged; its problems join ``problems``; a problem makes the run invalid).
    Idempotent: a summary judged before is judged afresh."""
    for s, problems in zip(summaries, judge(summaries)):
        fid = s["fidelity"]
        old = (fid.get("envelope") or {}).get("problems", [])
        fid["problems"] = [p for p in fid["problems"] if p not in old] + problems
        fid["envelope"] = {"push_overhead_s": overhead(s), "tpot_over_model": tpot_ratio(s),
                           "cpu_idle_median": cpu_idle(s), "problems": problems}
        fid["valid"] = not fid["problems"]
