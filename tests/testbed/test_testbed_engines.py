"""The testbed run's parts that need no fabric: the proxy's instance flags, the pushes read
from the connectors' records, the engines chosen once from the configuration, and the
client reading each request's transfer id from the proxy's answer header."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from rich.console import Console

from kvpath.proxy.config import TRANSFER_ID_HEADER
from kvpath.testbed.driver import drive
from kvpath.testbed.emulated_engines import EmulatedEngines
from kvpath.testbed.engine_kinds import engines_for
from kvpath.testbed.engines import RunSite
from kvpath.testbed.orchestrator import Push, proxy_argv, pushes
from kvpath.testbed.run_config import RunConfig
from kvpath.testbed.vllm_engines import VllmEngines
from kvpath.trace import ReceivedRecord, TransferRecord
from kvpath.workloads import Request, Workload

T1, T2 = "ce701065dac44f5b842e24d593f75e6a", "ef7f5eac35f64755bf4516d50b4b34c5"


def _site(tmp_path: Path, **kw) -> RunSite:
    cfg = RunConfig(out=str(tmp_path), **kw)
    spec, _, _ = cfg.validate()
    fabric = SimpleNamespace(spec=spec, prefix="kvp-test", MGMT_ROOT_IP="10.255.0.1",
                             mgmt_ip=lambda h: f"10.254.0.{spec.hosts().index(h) + 2}")
    return RunSite(fabric, cfg, ["l0h0"], ["l1h0"], tmp_path / "fabric.json", tmp_path)


def test_proxy_flags_with_a_push_connector_name_p_s_kv_address(tmp_path):
    site = _site(tmp_path)
    p_ip, d_ip = site.fabric.spec.host_ip("l0h0"), site.fabric.mgmt_ip("l1h0")
    assert site.proxy_instance_args() == [
        "--prefill", f"http://{site.fabric.mgmt_ip('l0h0')}:8000,kv_addr={p_ip}:5600,fabric_host=l0h0,engine_id=p-l0h0",
        "--decode", f"http://{d_ip}:8000,fabric_host=l1h0,engine_id=d-l1h0"]
    argv = proxy_argv(site, engines_for(site))
    assert argv[argv.index("--mode") + 1] == "push" and argv[argv.index("--reservation-mode") + 1] == "cc"
    # the emulated llama-3-8b's KV bytes per token, scaled down by S = 500
    assert argv[argv.index("--kv-bytes-per-token") + 1] == str(round(131072 / 500))


def test_at_unequal_tp_the_proxy_learns_ps_tp_size(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    site = _site(tmp_path, engine="vllm", tp="2:1")
    assert site.proxy_instance_args()[1].endswith(",engine_id=p-l0h0,tp=2")  # D's leg then names it
    assert ",tp=" not in _site(tmp_path, engine="vllm", tp="2:2").proxy_instance_args()[1]


def test_proxy_flags_with_the_pull_connector_reserve_nothing(tmp_path):
    site = _site(tmp_path, engine="vllm", connector="nixl", mode="ecmp")
    assert site.proxy_instance_args()[:2] == ["--prefill", f"{site.url('l0h0')},fabric_host=l0h0"]
    argv = proxy_argv(site, engines_for(site))
    assert argv[argv.index("--mode") + 1] == "pull"
    assert "--reservation" not in argv and "--kv-bytes-per-token" not in argv


def test_the_engines_are_chosen_once_from_the_configuration(tmp_path):
    emu, real = engines_for(_site(tmp_path)), engines_for(_site(tmp_path, engine="vllm"))
    assert isinstance(emu, EmulatedEngines) and emu.model_name == "llama-3-8b"
    assert isinstance(real, VllmEngines) and real.model_name == "tiny"
    # the tiny model's float32 K and V: 2 layers x 2 KV heads x 64 x 4 bytes, twice
    assert real.kv_bytes_per_token() == 2 * 2 * 2 * 64 * 4
    assert emu.decode_only([], None) is None and emu.kv_loss() is None


def _write_logs(tmp_path: Path) -> None:
    # P's log as the connector wrote it before schema version 2 (rows tagged "kind")...
    p_rows = [
        {"kind": "lanes", "engine": "p-l0h0", "peer": "d-l1h0-r0", "lanes": [[1, "10.0.2.1", 48439, "10.1.2.1", 39027,
                                                                              "tcp", "spine1"]]},
        {"kind": "kv_transfer", "transfer_id": T1, "request_id": "cmpl-a", "bytes": 285056, "descriptors": 1,
         "blocks": 68, "lane": 1, "src_port": 48439, "prefill_done_at": 100.0, "submit_at": 100.5,
         "completed_at": 100.6, "duration_s": 0.1, "status": "ok", "lease_id": "r1", "first_byte_at": None},
    ]
    text = "".join(json.dumps(r) + "\n" for r in p_rows)
    # ...and a record of the current schema after it
    text += msgspec.json.encode(TransferRecord(T2, "cmpl-b", bytes=1000, lane=0, src_port=51521, prefill_done_at=101.0,
                                               submit_at=101.2, completed_at=101.4, status="failed")).decode() + "\n"
    (tmp_path / "transfers-l0h0.jsonl").write_text(text)
    (tmp_path / "transfers-l1h0.jsonl").write_text(
        json.dumps({"kind": "kv_received", "transfer_id": T1, "request_id": "cmpl-a", "engine": "d-l1h0", "at": 100.7})
        + "\n" + msgspec.json.encode(ReceivedRecord(transfer_id="other", request_id="x", at=1.0)).decode() + "\n")


def test_tp_sizes_reach_each_engine_with_its_ranks_on_cores_from_its_own(tmp_path, monkeypatch):
    import os

    from kvpath.testbed.vllm_engines import Placement
    from kvpath.testbed.vllm_server import rank_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert rank_cores(0, 2) == [0, 1] and rank_cores(1, 2) == [1, 0] and rank_cores(1, 3) == [1, 0, 1]
    eng = VllmEngines(_site(tmp_path, engine="vllm", tp="2"))
    eng.site.fabric.exec_argv = lambda host, argv: ["ip", "netns", "exec", f"kvp-test-{host}", *argv]
    assert eng.site.cfg.tp_sizes == (2, 2)
    p = eng.server(Placement("l0h0", "prefill", "10.0.0.2", "10.254.0.2", 0), "/m", "http://x")
    d = eng.server(Placement("l1h0", "decode", "10.1.0.2", "10.254.0.3", 1), "/m", "http://x")
    for srv, bind in ((p, "0|1"), (d, "1|0")):
        cmd = srv.command()
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and srv.env["VLLM_CPU_OMP_THREADS_BIND"] == bind
        assert not srv.own_session  # at TP > 1 in the run's session (docs/connector-tp.md, "CPU 0 stalls")
    one_eng = VllmEngines(_site(tmp_path, engine="vllm"))
    one_eng.site.fabric.exec_argv = eng.site.fabric.exec_argv
    one = one_eng.server(Placement("l0h0", "prefill", "10.0.0.2", "10.254.0.2", 0),
                                                             "/m", "http://x")
    assert "--tensor-parallel-size" not in one.command() and "VLLM_CPU_OMP_THREADS_BIND" not in one.env
    assert one.own_session


def test_every_process_of_an_engine_is_bound_to_its_cores_not_only_the_openmp_threads():
    from kvpath.testbed.vllm_server import VLLMServer

    one = VLLMServer("/m", 8100, cpu=1, wrap=["ip", "netns", "exec", "ns"])
    cmd = one.command()
    assert cmd[:6] == ["ip", "netns", "exec", "ns", "taskset", "-c"] and cmd[6] == "1"  # inside the namespace
    tp2 = VLLMServer("/m", 8100, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert tp2.command()[:3] == ["taskset", "-c", "0,1"]  # TP ranks: every rank's core
    assert "taskset" not in VLLMServer("/m", 8100, cpu=1, pin_all=False).command()  # vLLM's own binding only
    assert "taskset" not in VLLMServer("/m", 8100).command()  # unbound engines stay unbound


def test_pushes_join_p_s_records_with_d_s_receipts(tmp_path):
    _write_logs(tmp_path)
    got = {p.record.transfer_id: p for p in pushes(_site(tmp_path))}
    assert set(got) == {T1, T2}
    a, b = got[T1], got[T2]
    assert a.p_host == b.p_host == "l0h0"
    assert (a.record.bytes, a.record.lane, a.record.src_port, a.record.status) == (285056, 1, 48439, "ok")
    assert a.received_at == 100.7 and a.end == 100.7  # the push ends when D has the last byte
    assert b.received_at is None and b.end == 101.4  # no receipt: P's completion
    assert Push(a.record, "l0h0").end == a.record.completed_at


def test_at_tp2_each_p_flow_meets_its_d_ranks_receipt_and_the_kv_is_ready_at_the_last(tmp_path):
    # one request, P TP=2 -> D TP=2: two flows (rank r -> rank r), landing at different times
    p_text = "".join(msgspec.json.encode(TransferRecord(T1, "cmpl-a", bytes=500, lane=r, src_port=40000 + r,
                                                        prefill_done_at=100.0, submit_at=100.1, completed_at=100.2,
                                                        status="ok", rank=r, peer_rank=r)).decode() + "\n"
                     for r in (0, 1))
    (tmp_path / "transfers-l0h0.jsonl").write_text(p_text)
    (tmp_path / "transfers-l1h0.jsonl").write_text("".join(
        msgspec.json.encode(ReceivedRecord(transfer_id=T1, request_id="d-a", at=at, rank=r)).decode() + "\n"
        for r, at in ((1, 100.9), (0, 100.4))))
    got = sorted(pushes(_site(tmp_path)), key=lambda p: p.record.rank)
    assert [(p.record.rank, p.received_at) for p in got] == [(0, 100.4), (1, 100.9)]
    recs = VllmEngines(_site(tmp_path, engine="vllm")).records()
    assert recs["l1h0"]["records"] == [{"transfer_id": T1, "kv_ready": 100.9}]  # the request's last flow


def test_vllm_records_come_from_the_connectors_logs(tmp_path):
    _write_logs(tmp_path)
    recs = VllmEngines(_site(tmp_path, engine="vllm")).records()
    assert recs["l0h0"] == {"role": "prefill", "kv_usage": 0, "records": [
        {"transfer_id": T1, "prefill_end": 100.0}, {"transfer_id": T2, "prefill_end": 101.0}]}
    assert recs["l1h0"]["role"] == "decode"
    assert recs["l1h0"]["records"] == [{"transfer_id": T1, "kv_ready": 100.7},
                                       {"transfer_id": "other", "kv_ready": 1.0}]
    # vLLM's own connector writes none: no records, even where a file is left over
    pull = VllmEngines(_site(tmp_path, engine="vllm", connector="nixl", mode="ecmp")).records()
    assert pull["l0h0"]["records"] == [] and pull["l1h0"]["records"] == []


def _sse(*texts: str, completion_id: str) -> bytes:
    events = [{"id": completion_id, "choices": [{"text": t}]} for t in texts]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


async def _drive_against(answer, wl: Workload, cfg: RunConfig) -> list[dict]:
    """``drive`` against a real HTTP server on localhost whose handler is ``answer``."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        rows, _ = await drive(f"http://127.0.0.1:{port}", wl, cfg, "m", Console(file=io.StringIO()))
    finally:
        await runner.cleanup()
    return rows


@pytest.mark.parametrize("header", [True, False])
def test_the_client_reads_the_transfer_id_from_the_proxy_s_header(tmp_path, header):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["stream"] is True and body["model"] == "m" and len(body["prompt"]) == 7
        # the completion id holds a transfer id too: it must not be what the client reads
        headers = {TRANSFER_ID_HEADER: T1} if header else {}
        return web.Response(status=200, headers=headers, body=_sse("a", "b", completion_id=f"cmpl-{T2}-0"))

    cfg = RunConfig(out=str(tmp_path), max_output=2, qps=100.0)
    (row,) = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 7, 5)]), cfg))
    assert row["transfer_id"] == (T1 if header else "")
    assert (row["status"], row["tokens"], row["text"], row["max_tokens"]) == ("ok", 2, "ab", 2)
    assert row["arrival"] <= row["first_token"] <= row["completion"]


def test_a_failed_answer_is_recorded_with_its_status(tmp_path):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=503, headers={TRANSFER_ID_HEADER: T1}, body=b"")

    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2)]), RunConfig(out=str(tmp_path))))
    assert rows[0]["status"] == "http 503" and rows[0]["tokens"] == 0 and "first_token" not in rows[0]


def test_a_garbled_stream_is_a_client_error_not_a_crash(tmp_path):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=200, body=b"data: {not json\n\n")

    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2), Request("r1", 0.0, 3, 2)]),
                                      RunConfig(out=str(tmp_path))))
    assert sorted(r["request_id"] for r in rows) == ["r0", "r1"]
    assert all(r["status"].startswith("client error") and r["tokens"] == 0 for r in rows)


@pytest.mark.parametrize("body", [b"data: 1\n\n", b'data: {"error": "s"}\n\n', b'data: {"choices": {"a": 1}}\n\n',
                                  b'data: {"choices": [{"text": null}]}\n\n', b'data: {"choices": {}}\n\n',
                                  b'data: {"id": "c"}\n\n', b'data: {"choices": [1]}\n\n'])
def test_an_event_of_the_wrong_shape_is_a_client_error_not_a_crash(tmp_path, body):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=200, body=body)

    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2)]), RunConfig(out=str(tmp_path))))
    assert rows[0]["status"].startswith("client error"), rows[0]


def test_a_usage_chunk_is_not_a_token(tmp_path):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        usage = b'data: {"id": "c", "choices": [], "usage": {"completion_tokens": 2}}\n\n'
        body = _sse("a", "b", completion_id="c")
        return web.Response(status=200, body=body.replace(b"data: [DONE]", usage + b"data: [DONE]"))

    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2)]), RunConfig(out=str(tmp_path))))
    assert (rows[0]["status"], rows[0]["tokens"], rows[0]["text"]) == ("ok", 2, "ab")


def test_a_stream_of_events_that_are_no_tokens_is_cut(tmp_path):
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:  # usage chunks forever: no token, but the stream must still end
            await resp.write(b'data: {"choices": [], "usage": {}}\n\n')

    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2)]), RunConfig(out=str(tmp_path))))
    assert rows[0]["status"].startswith("client error") and "events streamed" in rows[0]["status"]


def test_a_stream_that_does_not_end_is_cut_and_a_broken_one_keeps_its_transfer_id(tmp_path):
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={TRANSFER_ID_HEADER: T1})
        await resp.prepare(request)
        body = await request.json()
        if body["max_tokens"] == 2:  # r0: tokens forever
            while True:
                await resp.write(_sse("x", completion_id="c")[:-len(b"data: [DONE]\n\n")])
        await resp.write(_sse("a", completion_id="c")[:-len(b"data: [DONE]\n\n")])  # r1: a token, then a reset
        request.transport.close()
        return resp

    cfg = RunConfig(out=str(tmp_path), max_output=64)
    rows = asyncio.run(_drive_against(answer, Workload([Request("r0", 0.0, 3, 2), Request("r1", 0.0, 3, 3)]), cfg))
    by = {r["request_id"]: r for r in rows}
    assert by["r0"]["status"].startswith("client error") and "more than 2 tokens" in by["r0"]["status"]
    assert by["r1"]["status"].startswith("client error") and by["r1"]["tokens"] == 1
    assert by["r0"]["transfer_id"] == by["r1"]["transfer_id"] == T1  # tokens came: their push happened


def test_a_push_joins_its_request_and_lands_in_the_trace_with_its_lane(tmp_path):
    from dataclasses import asdict

    from kvpath.five_tuple import FiveTuple
    from kvpath.testbed.orchestrator import RunData
    from kvpath.testbed.run_report import join
    from kvpath.testbed.run_session import write_trace
    from kvpath.trace import read_trace

    _write_logs(tmp_path)
    site = _site(tmp_path)
    spec = site.fabric.spec
    p_ip, d_ip = spec.host_ip("l0h0"), spec.host_ip("l1h0")
    data = RunData(asdict(site.cfg), "kvp-test", ["l0h0"], ["l1h0"], 200.0, started=99.0)
    data.transfers = pushes(site)
    data.client = [{"request_id": "r0", "transfer_id": T1, "status": "ok", "arrival": 99.9, "prompt_tokens": 100,
                    "tokens": 3, "first_token": 100.8, "completion": 101.0}]
    data.engine_records = {"l0h0": {"role": "prefill", "records": [{"transfer_id": T1, "prefill_end": 100.0,
                                                                    "arrival": 99.925}]},
                           "l1h0": {"role": "decode", "records": [{"transfer_id": T1, "kv_ready": 100.7}]}}
    data.decisions = [{"transfer_id": T1, "lane": 1, "spine": "spine1"}]
    data.lanes_known = {"l0h0->l1h0": {"w0": [[1, 48439, 39027]]}}
    data.flow_bytes = {json.dumps(FiveTuple(p_ip, d_ip, 48439, 39027).to_dict()): {"spine1": 290000}}
    j = join(data, spec.host_ip)
    (r,) = j.requests
    assert (r["p_host"], r["d_host"], r["kv_bytes"], r["lane"]) == ("l0h0", "l1h0", 285056, 1)
    assert (r["push_start"], r["push_end"]) == (100.5, 100.7)  # the push ends at D's receipt
    assert r["front_end"] == pytest.approx(0.025)  # the client's send to P's server receiving it
    assert (r["src_port"], r["dst_port"], r["path_predicted"], r["path_measured"]) == (48439, 39027, "spine1", "spine1")
    write_trace(tmp_path / "trace.jsonl", data, j, spec)
    trace = read_trace(tmp_path / "trace.jsonl")
    (f,) = trace.flows
    assert (f.flow_id, f.lane, f.path, f.path_predicted) == (T1, 1, "spine1", "spine1")
    assert f.five_tuple == FiveTuple(p_ip, d_ip, 48439, 39027) and abs(f.fct_s - 0.2) < 1e-9
    assert trace.requests[0].push_end_s == r["push_end"] - 99.0
    assert trace.requests[0].p_arrival_s == pytest.approx(0.925)  # P's server receiving it, on the trace's clock


def test_the_run_token_reaches_the_proxy_and_the_engines_in_a_file_never_on_argv(tmp_path):
    # token_urlsafe starts with "-" once in 64 runs: argparse once took it for an option;
    # now only the file's path is on a command line (tests/kvpath/test_reservation_auth.py too)
    from kvpath.cli import build_parser

    site = _site(tmp_path)
    (tmp_path / "keys").mkdir(mode=0o700)
    (tmp_path / "keys" / "admin-token").write_text("-Xq3token")
    argv = proxy_argv(site, engines_for(site))
    args = build_parser().parse_args(argv[argv.index("proxy"):])
    assert args.admin_token is None and args.reservation_token_file == str(tmp_path / "keys" / "admin-token")
    assert not any("-Xq3token" in a for a in argv)
    engines = engines_for(site)
    assert isinstance(engines, EmulatedEngines)
    site.fabric.exec_argv = lambda host, argv: argv
    eargv = engines._argv("prefill", "l0h0", "http://10.255.0.1:18000")
    assert not any("-Xq3token" in a for a in eargv) and args.reservation_token_file in eargv
    assert site.admin_headers() == {"Authorization": "Bearer -Xq3token"}


def test_at_tp2_every_rank_pair_is_its_own_flow_on_its_own_reserved_spine(tmp_path):
    """P TP=2 -> D TP=2: a request is two pushes, one per rank pair, each on its pair's
    lane. The reservation took both pairs' lanes in one decision (``workers``/``spines``);
    each flow is judged against its own pair's spine, and the request's push spans both."""
    from dataclasses import asdict

    from kvpath.five_tuple import FiveTuple
    from kvpath.testbed.orchestrator import RunData
    from kvpath.testbed.run_report import fidelity, join, summarize
    from kvpath.testbed.run_session import write_trace
    from kvpath.trace import read_trace

    site = _site(tmp_path)
    spec = site.fabric.spec
    p_ip, d_ip = spec.host_ip("l0h0"), spec.host_ip("l1h0")
    data = RunData(asdict(site.cfg), "kvp-test", ["l0h0"], ["l1h0"], 200.0, started=99.0)
    data.transfers = [Push(TransferRecord(T1, "cmpl-a", bytes=1000, lane=0, src_port=40000 + r, prefill_done_at=100.0,
                                          submit_at=100.1 + r / 10, completed_at=100.4, status="ok", rank=r, peer_rank=r),
                           "l0h0", received_at=100.5 + r / 10) for r in (1, 0)]
    data.client = [{"request_id": "r0", "transfer_id": T1, "status": "ok", "arrival": 99.9, "prompt_tokens": 100,
                    "tokens": 3, "first_token": 100.8, "completion": 101.0}]
    data.engine_records = {"l0h0": {"role": "prefill", "records": [{"transfer_id": T1, "prefill_end": 100.0}]},
                           "l1h0": {"role": "decode", "records": [{"transfer_id": T1, "kv_ready": 100.6}]}}
    data.decisions = [{"transfer_id": T1, "lane": 0, "spine": "spine0", "spines": ["spine0", "spine1"],
                       "workers": ["p-l0h0/r0>d-l1h0/r0", "p-l0h0/r1>d-l1h0/r1"]}]
    data.lanes_known = {"l0h0->l1h0": {"p-l0h0/r0>d-l1h0/r0": [[0, 40000, 39000]],
                                       "p-l0h0/r1>d-l1h0/r1": [[0, 40001, 39001]]}}
    # rank 1's lane hashed onto spine0 this time: its flow disagrees with its reservation
    data.flow_bytes = {json.dumps(FiveTuple(p_ip, d_ip, 40000, 39000).to_dict()): {"spine0": 1030},
                       json.dumps(FiveTuple(p_ip, d_ip, 40001, 39001).to_dict()): {"spine0": 1020}}
    j = join(data, spec.host_ip)
    (r,) = j.requests
    assert (r["kv_bytes"], r["flows"], r["push_start"], r["push_end"]) == (2000, 2, 100.1, 100.6)
    assert r["paths"] == [("spine0", "spine0"), ("spine1", "spine0")]
    assert sorted((f["flow_id"], f["src_port"], f["dst_port"], f["path_predicted"], f["path"]) for f in j.flows) == [
        (f"{T1}/r0>r0", 40000, 39000, "spine0", "spine0"), (f"{T1}/r1>r1", 40001, 39001, "spine1", "spine0")]
    data.lone_flow_tries = [0.65, 1.03]  # the pacing check's connections: every one is reported
    fid = fidelity(data, j, 1.03)
    assert fid["spine_bytes_over_push_bytes"] == pytest.approx(2050 / 2000)  # both flows' bytes, not one
    assert (fid["lone_flow_rate_ratio"], fid["lone_flow_tries"]) == (1.03, [0.65, 1.03])
    s = summarize(data, j, fid, spec.host_ip)
    assert (s["pushes"], s["pushes_with_path"], s["path_agreement"]) == (1, 2, 0.5)
    write_trace(tmp_path / "trace.jsonl", data, j, spec)
    assert sorted(f.flow_id for f in read_trace(tmp_path / "trace.jsonl").flows) == [f"{T1}/r0>r0", f"{T1}/r1>r1"]


def test_p_tp2_into_d_tp1_each_flow_meets_its_own_receipt(tmp_path):
    # one request, P TP=2 -> D TP=1: two flows into D rank 0, told apart by the P rank
    p_text = "".join(msgspec.json.encode(TransferRecord(T1, "cmpl-a", bytes=500, lane=r, src_port=40000 + r,
                                                        prefill_done_at=100.0, submit_at=100.1, completed_at=100.2,
                                                        status="ok", rank=r, peer_rank=0)).decode() + "\n"
                     for r in (0, 1))
    (tmp_path / "transfers-l0h0.jsonl").write_text(p_text)
    (tmp_path / "transfers-l1h0.jsonl").write_text("".join(
        msgspec.json.encode(ReceivedRecord(transfer_id=T1, request_id="d-a", at=at, rank=0, peer_rank=p)).decode()
        + "\n" for p, at in ((1, 100.9), (0, 100.4))))
    got = sorted(pushes(_site(tmp_path)), key=lambda p: p.record.rank)
    assert [(p.record.rank, p.received_at) for p in got] == [(0, 100.4), (1, 100.9)]
    recs = VllmEngines(_site(tmp_path, engine="vllm")).records()
    assert recs["l1h0"]["records"] == [{"transfer_id": T1, "kv_ready": 100.9}]
