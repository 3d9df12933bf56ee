"""vLLM's kv_load_failure_policy=recompute: a push that never comes is recomputed on D."""

import httpx
import pytest

from kvpath.testbed.pd_client import make_prompts
from kvpath.testbed.vllm_server import VLLMServer, connector_config
from kvpath.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e


def test_missing_push_is_recomputed_on_d(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    ktc = connector_config("kv_consumer", 5840, keys_dir=logs / "keys", ucx_net_devices="lo",
                           registration_timeout_s=2.0)
    ktc["kv_load_failure_policy"] = "recompute"
    d = VLLMServer(model, 8340, cpu=1, log_path=str(logs / "d.log"), kv_transfer_config=ktc).start()
    try:
        d.wait_ready()
        prompt = make_prompts(1, seed=21)[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        # the push for this request never comes (nobody listens at the peer address)
        r = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
            **body, "kv_transfer_params": {"do_remote_prefill": True, "kvpath": {"transfer_id": "lost", "peer": "127.0.0.1:1"}}})
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] != "error"
        metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
        assert any(line.startswith("vllm:kvpath_recv_timeout_total") and float(line.split()[-1]) >= 1
                   for line in metrics.splitlines())
        local = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert choice["text"] == local
    finally:
        d.kill()
