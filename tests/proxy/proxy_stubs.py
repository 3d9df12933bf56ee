"""The proxy's test bench: stub engines (optionally behind vLLM's --api-key check), a
reservation service and the proxy in front, all on loopback (:class:`Setup`), and the
request the tests send. The ``setup`` fixture is tests/proxy/conftest.py."""

import time

import httpx

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.proxy.app import create_app
from kvpath.proxy.config import ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance
from kvpath.reservation.app import create_app as create_reservation_app
from kvpath.reservation.clients import HttpReserver, InProcessReserver
from kvpath.reservation.decisions import LaneInfo, ReservationService
from kvpath.reservation.wire import WorkerPair
from kvpath.testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
PORTS = iter(range(18000, 18999))


def lanes():
    return [LaneInfo(i, 40000 + i, 0) for i in range(8)]


def wait_until(cond, timeout_s=10.0):
    """Poll ``cond`` until true; the bound is generous (a busy 2-core machine), never asserted."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


class EngineKeyCheck:
    """vLLM's ``--api-key`` check, as vllm/entrypoints/serve/middleware/authenticate.py
    (0.32) does it: a path under /v1 needs ``Authorization: Bearer KEY`` (else 401
    ``{"error": "Unauthorized"}``), /health and /metrics stay open. ``seen``: the
    (path, Authorization) of every request."""

    def __init__(self, app, key):
        self.app, self.key, self.seen = app, key, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            self.seen.append((scope["path"], auth))
            if scope["path"].startswith("/v1") and auth != f"Bearer {self.key}":
                from starlette.responses import JSONResponse

                return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


RES_TOKEN = "r3s-t0ken"  # the reservation service's (the proxy's admin token is another)


class Setup:
    def __init__(self, mode="push", n_p=1, n_d=1, policy="round_robin", reservation="http", token="s3cret",
                 engine_key=None, p_tp=1, **cfg):
        self.pb = [StubBehaviour() for _ in range(n_p)]
        self.db = [StubBehaviour() for _ in range(n_d)]
        self.servers = []
        self.guards = []  # with engine_key: every engine checks it, as vLLM's --api-key does
        self.p = [self._serve(self._engine(create_stub_app(f"P{i}", b), engine_key)) for i, b in enumerate(self.pb)]
        self.d = [self._serve(self._engine(create_stub_app(f"D{i}", b), engine_key)) for i, b in enumerate(self.db)]
        if engine_key:
            cfg["engine_api_key"] = engine_key
        self.svc = ReservationService(SPEC, "cc", lease_s=30)
        self.svc.register_lanes("l0h0", "l1h0", lanes(), pair=WorkerPair(p_engine="eng0", d_engine="deng0"))
        reserver = None
        if reservation == "http":
            self.res = self._serve(create_reservation_app(self.svc, token=RES_TOKEN))
            reserver = HttpReserver(self.res.url, timeout_s=0.5, token=RES_TOKEN)
        elif reservation == "inproc":
            reserver = InProcessReserver(self.svc)
        self.proxy = Proxy(
            ProxyConfig(mode=mode, policy=policy, admin_token=token, **{"first_byte_timeout_s": 3.0, **cfg}),
            # p_tp: P's TP size as the operator gave it (tp=); 0: the proxy learns it
            [Instance(s.url, "prefill", "l0h0", f"127.0.0.1:{KV_SIDE_CHANNEL_PORT + i}", f"eng{i}", tp_size=p_tp)
             for i, s in enumerate(self.p)],
            [Instance(s.url, "decode", "l1h0", engine_id=f"deng{i}") for i, s in enumerate(self.d)],
            reserver,
        )
        res_app = create_reservation_app(self.svc, token=RES_TOKEN) if reservation == "inproc" else None
        self.px = self._serve(create_app(self.proxy, res_app))
        self.url = self.px.url

    def _engine(self, app, key):
        if not key:
            return app
        self.guards.append(EngineKeyCheck(app, key))
        return self.guards[-1]

    def _serve(self, app):
        s = ServerThread(app, next(PORTS)).start()
        self.servers.append(s)
        return s

    def close(self):
        for s in reversed(self.servers):
            s.stop()

    def p_legs(self, n, i=0):
        """P's records once ``n`` arrived: in the push modes D may answer before P's leg is logged."""
        assert wait_until(lambda: len(self.pb[i].received) >= n), f"P{i} got {len(self.pb[i].received)} of {n} legs"
        return self.pb[i].received

    def metrics(self):
        return httpx.get(self.url + "/metrics").text


def post(url, body, stream=False, timeout=10):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


BODY = {"model": "tiny", "prompt": "spine leaf lane path push pull", "max_tokens": 5}
