"""Section 1 of bench_connector.py: push latency through PushSender vs raw NIXL WRITEs, with
D's own stamps (TimedPeer) and the phase split (table 1b).

TimedPeer starts D with multiprocessing "spawn": the child imports this module to find
_serve_timed, which is why it lives in a module and not in the script.

Imported by bench_connector.py (kvpath installed, see scripts/setup.sh), which sets the UCX and
BLAS environment before numpy is imported.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import time

from rich.console import Console
from rich.table import Table

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layout import build_descs, layout_from_buffers
from kvpath.connector.messages import make_notif
from kvpath.connector.nixl_io import make_agent, register
from kvpath.connector.sender import PushSender
from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers
from connector_common import (
    CONTROL_KNOBS,
    LANES,
    MiB,
    REGIONS,
    _instrument,
    _record_sink,
    _wait_registrations,
    fmt_bytes,
    med,
    med_range,
    plan_push,
)

CONC = 16  # pushes in the concurrent pattern
SETTLE_S = 0.02  # after registering, before the push: control traffic and acks done


def _serve_timed(cfg: KVPathConfig, spec: BufferSpec, q_in, q_out, opts: dict) -> None:
    """PeerProcess's D loop (kvpath.testbed.peer_process.serve_decode, unchanged) plus two stamps
    taken inside D: when its receiver thread saw a push's completion notification
    (ReceiverState.on_done) and when the PeerProcess loop took the release
    (ReceiverState.take). ("stamps", request_ids) returns them, as time.monotonic()."""
    from kvpath.testbed import peer_process, recv_state

    seen: dict[str, float] = {}
    taken: dict[str, float] = {}
    on_done, take = recv_state.ReceiverState.on_done, recv_state.ReceiverState.take

    def stamped_on_done(self, transfer_id, *args):
        w = on_done(self, transfer_id, *args)
        if w is None and transfer_id.startswith("r") and self.get(transfer_id) is not None:
            # the raw-NIXL baseline's WRITEs come from the bench's own agents, for
            # registrations sent to no P: the receiver rightly refuses them as stray, so
            # the baseline accepts them here, as a receiver without that check would
            w = self.get(transfer_id)
            self._flow_ended(w, ok=True)
        if w is not None:
            seen[w.request_id] = time.monotonic()
        return w

    def stamped_take(self):
        r, f = take(self)
        now = time.monotonic()
        for rid in r:
            taken[rid] = now
        return r, f

    recv_state.ReceiverState.on_done = stamped_on_done
    recv_state.ReceiverState.take = stamped_take

    class Commands:  # answers "stamps" itself; the loop sees no command then
        def get(self, timeout=None):
            item = q_in.get(timeout=timeout)
            if item[0] == "stamps":
                q_out.put(("stamps", {r: seen.pop(r, None) for r in item[1]}, {r: taken.pop(r, None) for r in item[1]}))
                raise queue.Empty
            return item

    peer_process.serve_decode(cfg, spec, Commands(), q_out, opts)


class TimedPeer(PeerProcess):
    """A PeerProcess D that also answers ("stamps", request_ids)."""

    def __init__(self, cfg: KVPathConfig, spec: BufferSpec):
        super().__init__(cfg, spec)
        opts = {"netns": None, "compat": None, "canary": None}
        self.proc = mp.get_context("spawn").Process(
            target=_serve_timed, args=(cfg, spec, self.q_in, self.q_out, opts), daemon=True
        )

    def send(self, cmd: str, *args) -> None:
        self.q_in.put((cmd, *args))

    def recv(self, timeout: float = 60) -> tuple:
        return self.get(timeout)


# -- 1. push latency -------------------------------------------------------------------
PHASES = (
    ("hand", "P hand-over: submit_finished -> writer prepares the WRITE\n(raw: waiting behind the bench's earlier posts)"),
    ("wire", "P: initialize_xfer + post + progress until check_xfer_state says DONE"),
    ("rel", "P: release_xfer_handle (the TransferRecord's completed_at comes after it)"),
    ("to_d", "P saw DONE -> D's receiver thread saw the notification"),
    ("loop", "D saw it -> D's PeerProcess loop took the release"),
    ("reply", "loop took it -> bench got the 'wait' reply (per round)"),
    ("total", "total: submit -> D saw the notification"),
)


def _latency_one(mib: float, reps: int, port: int, **knobs) -> dict:
    """``knobs``: more connector knobs for both sides (section 7: kv_verify)."""
    blen, nb, nbytes = plan_push(mib)
    p_spec = BufferSpec(regions=REGIONS, num_blocks=nb, block_len=blen, block_size=16)
    d_spec = BufferSpec(regions=REGIONS, num_blocks=nb * CONC, block_len=blen, block_size=16)
    cfg = KVPathConfig(lanes=LANES, side_channel_port=port, ucx_net_devices="lo", lease_timeout_s=30,
                       registration_timeout_s=60, **CONTROL_KNOBS, **knobs)
    bufs = make_buffers(p_spec, "random", seed=2)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, nb, 16)
    sender = PushSender(cfg, lay, spans).start()
    recs = _record_sink(sender)
    xfer: dict = {}
    for agent in sender.lanes.agents:
        _instrument(agent, xfer)
    src = list(range(nb))
    dst = [list(range(j * nb, (j + 1) * nb)) for j in range(CONC)]
    kinds = [(path, n) for n in (1, CONC) for path in ("engine", "raw")]
    # per kind: per-round values and per-push phase samples
    rounds: dict = {k: {"d": [], "last": [], "p": [], "e2e": []} for k in kinds}
    phases: dict = {k: {p: [] for p, _ in PHASES} for k in kinds}
    bad: list[str] = []
    with TimedPeer(cfg, d_spec) as d:
        _, meta, _, dlay = d.call("info")
        raws = []
        for a in range(LANES):
            ag = make_agent(f"raw-{port}-{a}")
            register(ag, spans, "DRAM")
            raws.append((ag, ag.add_remote_agent(meta)))
        descs = [build_descs(lay, dlay, src, dst[j])[:2] for j in range(CONC)]

        def arm(tag: str, n: int, peer: str) -> list[str]:
            """Register n pushes on D and arm D's waiter, before the clock starts."""
            rids = [f"d-{tag}-{j}" for j in range(n)]
            for j in range(n):
                d.send("register", rids[j], f"{tag}-{j}", peer, dst[j], 0)
            for _ in range(n):
                d.recv()
            d.send("wait", rids, 120)
            return rids

        def engine_round(tag: str, n: int) -> tuple:
            base = sender.stats.snapshot()["registrations"]
            rids = arm(tag, n, sender.address)
            _wait_registrations(sender, base + n)
            time.sleep(SETTLE_S)
            t_sub = []
            for j in range(n):
                t_sub.append(time.monotonic())
                sender.submit_finished(f"p-{tag}-{j}", f"{tag}-{j}", src, lane=j % LANES)
            res = d.recv()
            t_reply = time.monotonic()
            deadline = time.monotonic() + 10
            while any(f"{tag}-{j}" not in recs for j in range(n)) and time.monotonic() < deadline:
                time.sleep(0.001)
            off = time.time() - time.monotonic()
            sender.take_finished()
            post, done_p, rel = [], [], []
            for j in range(n):
                r = recs.pop(f"{tag}-{j}", None)
                x = xfer.pop(f"{tag}-{j}", {})
                ok = r is not None and r.status == "ok"
                post.append(r.submit_at - off if ok else math.nan)
                done_p.append(x.get("done", math.nan))
                rel.append(x.get("release", math.nan))
            return rids, res, [t_sub[0]] * n, post, done_p, rel, t_reply  # all n handed over with the first

        def raw_round(tag: str, n: int) -> tuple:
            rids = arm(tag, n, "127.0.0.1:1")  # a P that never answers: D only waits for the notification
            time.sleep(SETTLE_S)
            t0, t_start, hs = time.monotonic(), [], []
            for j in range(n):  # all n prefills are handed over at t0; the bench posts them one after the other
                ag, name = raws[j % LANES]
                loc, rem = descs[j]
                t_start.append(time.monotonic())
                h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(loc, "DRAM"), ag.get_xfer_descs(rem, "DRAM"), name,
                                       make_notif(f"{tag}-{j}"))
                st = ag.transfer(h)
                hs.append([ag, h, st, time.monotonic() if st != "PROC" else math.nan])
            todo = [x for x in hs if x[2] == "PROC"]
            while todo:  # tight poll, as raw NIXL without a progress thread does
                for x in todo:
                    x[2] = x[0].check_xfer_state(x[1])
                    if x[2] != "PROC":
                        x[3] = time.monotonic()
                todo = [x for x in todo if x[2] == "PROC"]
            rel = []
            for ag, h, st, _ in hs:
                t1 = time.monotonic()
                ag.release_xfer_handle(h)
                rel.append(time.monotonic() - t1)
                if st != "DONE":
                    bad.append(f"raw {tag}: {st}")
            res = d.recv()
            t_reply = time.monotonic()
            return rids, res, [t0] * n, t_start, [x[3] for x in hs], rel, t_reply

        for i in range(reps + 1):  # round 0 opens every connection and is not counted
            order = kinds if i % 2 == 0 else [kinds[1], kinds[0], kinds[3], kinds[2]]
            for path, n in order:
                tag = f"{path[0]}{n}-{i}"
                rids, res, t_sub, post, done_p, rel, t_reply = (engine_round if path == "engine" else raw_round)(tag, n)
                _, done, failed = res
                if sorted(done) != sorted(rids) or failed:
                    bad.append(f"{tag}: {len(done)}/{n} released, {len(failed)} failed")
                    continue
                _, seen, taken = d.call("stamps", rids)
                if i == 0:
                    continue
                seen_l, taken_l = [seen[r] for r in rids], [taken[r] for r in rids]
                lat = [s - t for s, t in zip(seen_l, t_sub)]
                k = (path, n)
                rounds[k]["d"].append(med(lat))
                rounds[k]["last"].append(max(seen_l) - min(t_sub))
                rounds[k]["p"].append(med([b - a for a, b in zip(post, done_p)]))
                rounds[k]["e2e"].append(t_reply - min(t_sub))
                ph = phases[k]
                for j in range(n):
                    ph["hand"].append(post[j] - t_sub[j])
                    ph["wire"].append(done_p[j] - post[j])
                    ph["rel"].append(rel[j])
                    ph["to_d"].append(seen_l[j] - done_p[j])
                    ph["loop"].append(taken_l[j] - seen_l[j])
                    ph["total"].append(lat[j])
                ph["reply"].append(t_reply - max(taken_l))
        exact = all(d.call("read", dst[j][:2])[1] == [b.reshape(nb, blen)[:2].tobytes() for b in bufs]
                    for j in (0, CONC - 1))
    sender.close()
    return {"mib": mib, "bytes": nbytes, "block_len": blen, "blocks": nb, "rounds": rounds, "phases": phases,
            "exact": exact, "bad": bad, "reps": reps}


def latency_target(nbytes: int) -> float | None:
    if nbytes <= 256 * 1024:
        return 1.3
    if nbytes >= 64 * MiB:
        return 1.05
    return None


def bench_latency(console: Console, sizes: list[float], reps: int, samples: bool) -> list[dict]:
    out = [_latency_one(mib, reps, 6300 + 10 * k) for k, mib in enumerate(sizes)]
    t = Table(title=f"1. push latency, ms: median (min-max) of {reps} rounds; engine and raw rounds alternate; "
                    f"UCX TCP on loopback; D registered first", show_lines=True)
    for c in ("push", "pattern", "path", "hand-over -> D saw\nthe notification\n(stamped in D)",
              f"last of {CONC}\nat D", "P's view: WRITE\nprepared -> DONE\n(check_xfer_state)", "end to end: bench\ngot D's 'wait' reply",
              "engine / raw"):
        t.add_column(c)
    for r in out:
        size = f"{fmt_bytes(r['bytes'])}\n{r['bytes']:,} B\n= {r['blocks']} x {REGIONS} x {r['block_len']} B"
        r["ratios"] = {}
        tgt = latency_target(r["bytes"])
        for n in (1, CONC):
            e, w = r["rounds"][("engine", n)], r["rounds"][("raw", n)]
            pattern = "1 at a time" if n == 1 else f"{CONC} at once\nover {LANES} lanes"
            ratio_cell = "-"
            if e["d"] and w["d"]:
                ratio = med(e["d"]) / med(w["d"])
                r["ratios"][n] = (ratio, tgt)
                paired = [a / b for a, b in zip(e["d"], w["d"])]
                ratio_cell = f"[bold]{ratio:.2f}[/bold]"
                if tgt is not None:
                    ratio_cell += f" (target <= {tgt}: {'yes' if ratio <= tgt else '[red]NO[/red]'})"
                ratio_cell += f"\npaired rounds {min(paired):.2f}-{max(paired):.2f}"
                if n > 1:
                    ratio_cell += f"\nlast of {CONC}: {med(e['last']) / med(w['last']):.2f}"
                ratio_cell += f"\nend to end: {med(e['e2e']) / med(w['e2e']):.2f}"
            for path, row in (("kvpath engine", e), ("raw NIXL", w)):
                t.add_row(size, pattern, path, med_range(row["d"]), med_range(row["last"]) if n > 1 else "",
                          med_range(row["p"]), med_range(row["e2e"]), ratio_cell if path == "kvpath engine" else "")
                size = pattern = ""
    console.print(t)
    console.print(
        "  hand-over: P's (first) submit_finished (engine), or the moment the bench starts posting (raw): "
        f"the {CONC} concurrent prefills count as handed over together, then are submitted or posted one by one. 'D saw': D's receiver "
        "thread got the NIXL notification (ReceiverState.on_done, stamped in D: CLOCK_MONOTONIC is one clock for all "
        f"processes). With {CONC} at once a round counts its median push; 'last' is its last notification. P's view: "
        "from the TransferRecord's submit_at (raw: before get_xfer_descs) until P's check_xfer_state first said DONE "
        "(the record's completed_at comes later, after release_xfer_handle: see 1b). End to end adds D's "
        "PeerProcess loop (2 ms queue timeout) and the reply's trip back. The ratio compares 'D saw'."
    )
    for r in out:
        if r["bad"]:
            console.print(f"  [red]{fmt_bytes(r['bytes'])}: {len(r['bad'])} rounds not counted[/red]: {r['bad'][:3]}")
        if not r["exact"]:
            console.print(f"  [red]{fmt_bytes(r['bytes'])}: bytes on D differ from P's[/red]")
    for r in out:
        t = Table(title=f"1b. where a {fmt_bytes(r['bytes'])} push's time goes, ms: median (min-max) over all pushes")
        t.add_column("phase")
        for n in (1, CONC):
            for path in ("engine", "raw"):
                t.add_column(f"{path}, {'1 at a time' if n == 1 else f'{CONC} at once'}")
        for key, label in PHASES:
            cells = []
            for n in (1, CONC):
                for path in ("engine", "raw"):
                    v = [x for x in r["phases"][(path, n)][key] if not math.isnan(x)]
                    cells.append("-" if path == "raw" and key == "hand" and n == 1 else med_range(v))
            t.add_row(label, *cells)
        console.print(t)
        if samples:
            for (path, n), ph in r["phases"].items():
                for key, _ in PHASES:
                    v = sorted(round(x * 1e3, 2) for x in ph[key] if not math.isnan(x))
                    console.print(f"  {fmt_bytes(r['bytes'])} {path} x{n} {key}: {v}", soft_wrap=True)
    return out
