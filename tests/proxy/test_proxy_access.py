"""The P/D proxy against stub engines: what it lets through and who may see what:
malformed and unsupported requests refused before any leg, the engines' API key on
the legs (never the client's), the admin token, the status without engine addresses."""

import hmac
import json

import httpx
import pytest

from kvpath.proxy.config import TRANSFER_ID_HEADER, ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance
from kvpath.testbed.stub_engine import ServerThread, create_stub_app
from tests.proxy.proxy_stubs import BODY, PORTS, post


MALFORMED = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 422, "model"),
    (json.dumps({"model": "tiny"}).encode(), 422, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 422, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "ten"}).encode(), 422, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": {"a": 1}}).encode(), 422, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 422, "stream"),
]


@pytest.mark.parametrize("raw, status, field", MALFORMED)
def test_malformed_requests_get_clear_errors(setup, raw, status, field):
    r = httpx.post(setup.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"]
    if field:
        assert any(field in f for f in err["fields"])
    assert not setup.pb[0].received and not setup.db[0].received  # nothing reached the engines


def test_chat_schema_errors_name_the_field(setup):
    r = httpx.post(setup.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 422 and "messages" in r.json()["error"]["fields"][0]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
ALL_MODES = [{"mode": "push"}, {"mode": "inproc-push"}, {"mode": "pull"}]


def refused(r, field):
    """A 400 from the proxy itself, in its error shape, naming ``field``."""
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == 400 and err["fields"] == [field] and err["message"].startswith(f"{field}: ")
    assert TRANSFER_ID_HEADER.lower() not in r.headers  # refused before any leg was sent
    return err["message"]


@pytest.mark.parametrize("setup", [{"mode": "inproc-push"}], indirect=True)
def test_n_above_1_is_refused_in_inproc_push_mode(setup):
    asks = [("/v1/completions", {**BODY, "n": 2}), ("/v1/chat/completions", {**CHAT, "n": 3}),
            ("/v1/completions", {**BODY, "n": 2, "stream": True})]
    for path, body in asks:
        msg = refused(httpx.post(setup.url + path, json=body, timeout=10), "n")
        assert "separate requests" in msg
    assert not setup.db[0].received and not setup.pb[0].received
    assert 'kvpath_proxy_errors_total{kind="unsupported"} 3.0' in setup.metrics()
    assert post(setup.url, {**BODY, "n": 1}).status_code == 200


def test_n_above_1_is_served_in_push_mode_with_one_prefill_and_one_push(setup):
    """D's child requests share one push: P's leg computes one prefill (n 1, no
    best_of), D's leg keeps the client's n."""
    for path, body in (("/v1/completions", {**BODY, "n": 2, "best_of": 1}),
                       ("/v1/chat/completions", {**CHAT, "n": 3}),
                       ("/v1/completions", {**BODY, "n": 4, "stream": True})):
        r = httpx.post(setup.url + path, json=body, timeout=10)
        assert r.status_code == 200, r.text
    p_legs, d_legs = setup.p_legs(3), setup.db[0].received
    assert [leg["body"]["n"] for leg in p_legs] == [1, 1, 1]
    assert [leg["body"]["n"] for leg in d_legs] == [2, 3, 4]
    assert all("best_of" not in leg["body"] for leg in p_legs) and d_legs[0]["body"]["best_of"] == 1
    # one push per request: both legs of each carry the same one transfer id
    assert [leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in p_legs] == \
        [leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in d_legs]


@pytest.mark.parametrize("setup", [{"mode": "pull"}], indirect=True)
def test_pull_mode_passes_n_on(setup):
    assert post(setup.url, {**BODY, "n": 2}).status_code == 200
    assert setup.pb[0].received[0]["body"]["n"] == 2 and setup.db[0].received[0]["body"]["n"] == 2


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_n_must_be_an_integer_in_range_never_a_string(setup):
    """vLLM's pydantic takes "2" for 2: passed on as a string, it would slip past every
    check of n and fan out on the engines."""
    for bad in ("2", "1", 2.0, 0, -1, 129, True, [2], {"n": 2}):
        for path, body in (("/v1/completions", {**BODY, "n": bad}), ("/v1/chat/completions", {**CHAT, "n": bad})):
            msg = refused(httpx.post(setup.url + path, json=body, timeout=10), "n")
            assert "integer from 1 to 128" in msg
    assert "the string '2'" in refused(post(setup.url, {**BODY, "n": "2"}), "n")
    assert not setup.db[0].received and not setup.pb[0].received
    assert post(setup.url, {**BODY, "n": None}).status_code == 200


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_best_of_above_1_or_not_an_integer_is_refused_in_every_mode(setup):
    """vLLM 0.32's completions request has no best_of (it takes the field and ignores
    it), so best_of 2 would silently not be the best of 2."""
    assert "vLLM ignores best_of" in refused(post(setup.url, {**BODY, "best_of": 2}), "best_of")
    for bad in ("3", "1", 1.0, 0, True):
        refused(post(setup.url, {**BODY, "best_of": bad}), "best_of")
    refused(httpx.post(setup.url + "/v1/chat/completions", json={**CHAT, "best_of": 2}, timeout=10), "best_of")
    assert not setup.db[0].received and not setup.pb[0].received
    assert post(setup.url, {**BODY, "best_of": 1}).status_code == 200
    assert post(setup.url, {**BODY, "best_of": None}).status_code == 200


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_a_batch_of_prompts_is_refused_in_the_push_modes(setup):
    """vLLM makes one request per prompt of a batch, all with the leg's one
    kv_transfer_params: one push cannot serve them. A batch of one is one prompt."""
    mode = setup.proxy.cfg.mode
    batches = [["spine leaf", "lane path"], [[1, 2, 3], [4, 5, 6]], ["a", "b", "c"]]
    for prompt in batches:
        r = post(setup.url, {**BODY, "prompt": prompt})
        if mode == "pull":
            assert r.status_code == 200, r.text
        else:
            assert "batch of" in refused(r, "prompt")
    if mode != "pull":
        assert not setup.db[0].received and not setup.pb[0].received
    for one in (["spine leaf"], [[1, 2, 3]], [1, 2, 3]):
        assert post(setup.url, {**BODY, "prompt": one}).status_code == 200


def test_admin_add_remove_requires_the_token(setup):
    extra = ServerThread(create_stub_app("D-extra"), next(PORTS)).start()
    setup.servers.append(extra)
    body = {"role": "decode", "url": extra.url, "fabric_host": "l1h1"}
    assert httpx.post(setup.url + "/admin/instances", json=body).status_code == 401
    assert httpx.post(setup.url + "/admin/instances", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    h = {"Authorization": "Bearer s3cret"}
    assert httpx.post(setup.url + "/admin/instances", json={**body, "role": "chef"}, headers=h).status_code == 422
    assert httpx.post(setup.url + "/admin/instances", json={"role": "prefill", "url": extra.url}, headers=h).status_code == 422
    assert httpx.post(setup.url + "/admin/instances", json=body, headers=h).status_code == 201
    assert len(httpx.get(setup.url + "/status").json()["decode"]) == 2
    r = httpx.delete(setup.url + "/admin/instances", params={"role": "decode", "url": setup.d[0].url}, headers=h)
    assert r.status_code == 200
    assert post(setup.url, BODY).status_code == 200
    assert len(setup.db[0].received) == 0  # removed instance gets nothing
    assert httpx.delete(setup.url + "/admin/instances", params={"role": "decode", "url": "http://x:1"}, headers=h).status_code == 404


ENGINE_KEY = "ek-7Qx2-engine-key"


@pytest.mark.parametrize("setup", [{"mode": m, "engine_key": ENGINE_KEY} for m in ("push", "inproc-push", "pull")],
                         indirect=True)
def test_both_legs_carry_the_engine_key_never_the_clients(setup):
    """Engines run with vLLM's --api-key: the proxy's own key goes on both legs and on
    GET /v1/models; a client's Authorization (a key for the proxy, or a guess) is never
    forwarded in its place. Health probes need none (vLLM leaves /health open)."""
    for client_auth in (None, "Bearer client-key", f"Bearer {ENGINE_KEY}-not"):
        hdr = {"Authorization": client_auth} if client_auth else {}
        r = httpx.post(setup.url + "/v1/completions", json=BODY, headers=hdr, timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.post(setup.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=hdr, timeout=10)
        assert r.status_code == 200 and b"chat.completion.chunk" in r.content
    legs = setup.p_legs(6) + setup.db[0].received
    assert len(legs) == 12 and all(leg["headers"]["authorization"] == f"Bearer {ENGINE_KEY}" for leg in legs)
    r = httpx.get(setup.url + "/v1/models", headers={"Authorization": "Bearer client-key"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    seen = [auth for g in setup.guards for path, auth in g.seen if path.startswith("/v1")]
    assert seen and set(seen) == {f"Bearer {ENGINE_KEY}"}
    # the key is not part of what /status or the config's repr show
    assert ENGINE_KEY not in httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).text
    assert ENGINE_KEY not in repr(setup.proxy.cfg)


@pytest.mark.parametrize("setup", [{"engine_key": ENGINE_KEY}], indirect=True)
def test_without_the_engine_key_engines_refuse_the_legs(setup):
    """The stubs' check is what vLLM does with --api-key: a proxy without the key gets
    401 from them (502 to the client), so the test above checks something real."""
    assert httpx.post(setup.d[0].url + "/v1/completions", json=BODY).status_code == 401
    assert httpx.get(setup.d[0].url + "/health").status_code == 200  # open, as in vLLM
    setup.proxy.engine_headers = {}
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "refused the proxy's engine API key (401" in r.json()["error"]["message"]
    assert 'kvpath_proxy_errors_total{kind="upstream_auth"}' in setup.metrics()


def _garbling_engine():
    """A TCP server that answers every request with a malformed status line: aiohttp
    then raises a ClientResponseError, whose repr holds the request's headers."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve():
        while True:
            try:
                c, _ = sock.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 20x OK\r\nContent-Length: 2\r\n\r\nhi")

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("setup", [{"engine_key": ENGINE_KEY, "health_interval_s": 0}], indirect=True)
def test_an_engines_malformed_answer_never_shows_the_engine_key(setup, caplog):
    sock, bad = _garbling_engine()
    try:
        setup.proxy.pools["decode"].add(Instance(bad, "decode", "l1h0", engine_id="deng0"))
        setup.proxy.pools["decode"].remove(setup.d[0].url)
        for body in (BODY, {**BODY, "stream": True}):
            r = post(setup.url, body)
            assert r.status_code == 502 and "ClientResponseError" in r.text and "20x" in r.text
            assert ENGINE_KEY not in r.text
        assert httpx.get(setup.url + "/v1/models").status_code == 502
        assert ENGINE_KEY not in caplog.text and "ClientResponseError" in caplog.text
    finally:
        sock.close()


def test_engine_api_key_must_be_one_printable_line():
    for bad in ("", "two\nlines", "tab\tkey", "caf\u00e9"):
        with pytest.raises(ValueError, match="engine API key"):
            Proxy(ProxyConfig(engine_api_key=bad), [], [])


def test_status_shows_engine_addresses_only_with_the_admin_token(setup):
    assert post(setup.url, BODY).status_code == 200
    private = ("url", "kv_addr", "fabric_host", "engine_id")
    public = httpx.get(setup.url + "/status")
    assert public.status_code == 200
    st = public.json()
    assert st["redacted"] is True and st["mode"] == "push"
    for role in ("prefill", "decode"):
        (inst,) = st[role]
        assert not set(private) & set(inst)
        assert inst["index"] == 0 and inst["healthy"] is True and inst["served"] >= 1 and inst["errors"] == 0
    for where in (setup.p[0].url, setup.d[0].url, "127.0.0.1:", "l0h0", "eng0", "deng0"):
        assert where.split("//")[-1] not in public.text, where
    full = httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).json()
    assert full["redacted"] is False
    assert full["prefill"][0]["url"] == setup.p[0].url and full["decode"][0]["url"] == setup.d[0].url
    assert full["prefill"][0]["kv_addr"].startswith("127.0.0.1:") and full["prefill"][0]["engine_id"] == "eng0"
    wrong = httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3creT"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401 and setup.p[0].url not in wrong.text


@pytest.mark.parametrize("setup", [{"token": None}], indirect=True)
def test_status_without_an_admin_token_configured_never_shows_addresses(setup):
    assert setup.d[0].url not in httpx.get(setup.url + "/status").text
    assert httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).status_code == 401


def test_admin_token_is_compared_in_constant_time(setup, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    body = {"role": "decode", "url": "http://127.0.0.1:9", "fabric_host": "l1h1"}
    r = httpx.post(setup.url + "/admin/instances", json=body, headers={"Authorization": "Bearer s3creT"})
    assert r.status_code == 401
    assert calls == [(b"Bearer s3creT", b"Bearer s3cret")]

