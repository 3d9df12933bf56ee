"""Request body size limits: the proxy's (max_body_bytes) and the reservation service's."""

import json

import httpx
import pytest

from kvpath.reservation.app import MAX_BODY_BYTES
from tests.proxy.proxy_stubs import BODY, Setup, wait_until

LIMIT = 4096


@pytest.fixture
def small():
    s = Setup(max_body_bytes=LIMIT, reservation="inproc")
    yield s
    s.close()


def _big_body(n: int) -> dict:
    return {**BODY, "prompt": "x" * n}


def test_a_body_over_the_limit_is_413_and_never_reaches_an_engine(small):
    r = httpx.post(small.url + "/v1/completions", json=_big_body(2 * LIMIT), timeout=10)
    assert r.status_code == 413 and f"{LIMIT} bytes" in r.json()["error"]["message"]
    assert small.pb[0].received == [] and small.db[0].received == []
    # a body just under the limit passes
    ok = _big_body(LIMIT - 200)
    assert len(json.dumps(ok)) < LIMIT
    assert httpx.post(small.url + "/v1/completions", json=ok, timeout=10).status_code == 200


def test_a_chunked_body_without_length_is_cut_off_at_the_limit(small):
    def chunks():
        for _ in range(64):  # 64 KiB in all, no Content-Length
            yield b"x" * 1024

    r = httpx.post(small.url + "/v1/completions", content=chunks(), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert small.pb[0].received == []
    # a chunked body under the limit is read whole and served
    body = json.dumps(BODY).encode()
    r = httpx.post(small.url + "/v1/completions", content=iter([body[:10], body[10:]]), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_the_limit_covers_admin_and_the_mounted_reservation_service(small):
    big = b"{" + b" " * (2 * LIMIT) + b"}"
    r = httpx.post(small.url + "/admin/instances", content=big, timeout=10,
                   headers={"authorization": "Bearer s3cret", "content-type": "application/json"})
    assert r.status_code == 413
    # the proxy's own limit (the smaller one here) is checked first
    r = httpx.post(small.url + "/reservation/v1/reserve", content=b" " * (2 * LIMIT), timeout=10)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]
    # the proxy still answers
    assert httpx.post(small.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def test_the_standalone_reservation_service_refuses_a_huge_body():
    s = Setup(reservation="http")
    try:
        r = httpx.post(s.res.url + "/v1/reserve", content=b"[" + b"1," * MAX_BODY_BYTES + b"1]", timeout=10)
        assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]["message"]
        assert wait_until(lambda: s.svc.state()["active"] == 0)
    finally:
        s.close()


def test_a_limit_below_1_kib_is_a_config_error():
    from kvpath.proxy.config import ProxyConfig

    with pytest.raises(ValueError, match="max_body_bytes"):
        ProxyConfig(max_body_bytes=10).validate()


def test_routes_other_than_inference_take_at_most_64_kib():
    s = Setup()  # the default limit (32 MiB) for inference
    try:
        r = httpx.post(s.url + "/admin/instances", content=b" " * (100 * 1024), timeout=10,
                       headers={"authorization": "Bearer s3cret", "content-type": "application/json"})
        assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
        big_prompt = {**BODY, "prompt": "x" * (200 * 1024)}  # a long prompt is fine
        assert httpx.post(s.url + "/v1/completions", json=big_prompt, timeout=10).status_code == 200
    finally:
        s.close()
