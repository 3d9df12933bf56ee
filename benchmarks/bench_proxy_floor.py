"""The floor of a streaming P/D relay in Python: what the least a proxy must do costs.

    .venv/bin/python benchmarks/bench_proxy_floor.py [--streams 64] [--rounds 3] [--tokens 16]
                                                     [--stacks uvicorn aiohttp granian]

A relay with nothing of kvpath's proxy: read the client's JSON body, send P a
one-token leg and D the streamed leg (one aiohttp session, keep-alive), relay each of
D's chunks to the client as it comes, on uvicorn with uvloop and httptools (the stack
`kvpath proxy` runs on). No validation, reservation, metrics, health checks, timeouts
or error handling. Against the same stub engines as benchmarks/bench_proxy.py, rounds
alternating with `kvpath proxy --reservation none` (no lane reserved: the relay's own
work only), it prints both processes' CPU per request: what kvpath's proxy adds over
the floor, and how far below today's cost any proxy on this stack can go (the floor's
CPU goes to the sockets' system calls and the event loop, per request and per
streamed chunk). ``--stacks`` adds the same relay on other servers of the field, in the
same alternating rounds: ``aiohttp`` (aiohttp.web's server, uvloop) and ``granian``
(a Rust HTTP server calling Python through its RSGI interface; used when installed,
``pip install granian``), and ``raw``: bare asyncio protocols on uvloop with httptools
parsing both sides, no server framework at all; ``raw-legs``: uvicorn serving the
client, the legs on raw pooled httptools connections (no aiohttp); ``nginx``: nginx
(compiled, one worker) with its Lua module sending P's leg as a subrequest and
streaming D's answer with ``proxy_pass`` (P's leg ends before D's starts: the same work,
at a lower request rate); ``nginx-1leg``: nginx streaming D's answer only, no P leg and
no Lua (less than any P/D proxy must do). The nginx stacks are used when nginx and its
Lua module are installed (Debian: ``apt-get install nginx libnginx-mod-http-lua
lua-cjson``). Each process's CPU is split into user and system (kernel) time: on
loopback the kernel's TCP work for a relayed stream, both ends of each socket, is
charged to the processes that write to it."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import uvloop
from rich.console import Console
from rich.table import Table

from bench_proxy import STUB, cpu_split_s, run_streams
from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.testbed.readiness import free_port, terminate, wait_http

RELAY = """
import asyncio, json
import aiohttp, uvicorn
P, D = {p!r}, {d!r}
session = None

async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({{"type": "lifespan.startup.complete"}})
        await send({{"type": "lifespan.shutdown.complete"}})
        return
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
    body, more = b"", True
    while more:
        m = await receive()
        body, more = body + m.get("body", b""), m.get("more_body", False)
    b = json.loads(body)
    p = asyncio.ensure_future(session.post(P + "/v1/completions", json={{**b, "max_tokens": 1, "stream": False}}))
    r = await session.post(D + "/v1/completions", json=b)
    await send({{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}})
    async for chunk in r.content.iter_any():
        await send({{"type": "http.response.body", "body": chunk, "more_body": True}})
    await send({{"type": "http.response.body", "body": b"", "more_body": False}})
    r.release()
    pr = await p
    await pr.read()
    pr.release()

uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", backlog=4096, proxy_headers=False)
"""

AIOHTTP_RELAY = """
import asyncio, json
import aiohttp, uvloop
from aiohttp import web
P, D = {p!r}, {d!r}

async def handle(request):
    session = request.app["session"]
    b = json.loads(await request.read())
    p = asyncio.ensure_future(session.post(P + "/v1/completions", json={{**b, "max_tokens": 1, "stream": False}}))
    r = await session.post(D + "/v1/completions", json=b)
    resp = web.StreamResponse(status=200, headers={{"content-type": "text/event-stream"}})
    await resp.prepare(request)
    async for chunk in r.content.iter_any():
        await resp.write(chunk)
    await resp.write_eof()
    r.release()
    pr = await p
    await pr.read()
    pr.release()
    return resp

async def init():
    app = web.Application()
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
    app.router.add_post("/v1/completions", handle)
    return app

uvloop.install()
web.run_app(init(), host="127.0.0.1", port={port}, access_log=None, backlog=4096, print=None)
"""

# granian imports the app by name: the module is written to a file of its own
GRANIAN_RELAY = """
import asyncio, json
import aiohttp
P, D = {p!r}, {d!r}
session = None

async def app(scope, proto):
    global session
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
    b = json.loads(await proto())
    p = asyncio.ensure_future(session.post(P + "/v1/completions", json={{**b, "max_tokens": 1, "stream": False}}))
    r = await session.post(D + "/v1/completions", json=b)
    t = proto.response_stream(200, [("content-type", "text/event-stream")])
    async for chunk in r.content.iter_any():
        await t.send_bytes(chunk)
    r.release()
    pr = await p
    await pr.read()
    pr.release()
"""


# the same relay with no HTTP server framework: asyncio protocols on uvloop, httptools
# parsing both sides, D's body re-chunked to the client straight from the parser's callback
RAW_RELAY = """
import asyncio, json
from urllib.parse import urlsplit
import httptools, uvloop
P, D = {p!r}, {d!r}

class Upstream(asyncio.Protocol):
    def __init__(self, pool):
        self.pool, self.parser, self.sink, self.done = pool, httptools.HttpResponseParser(self), None, None
    def connection_made(self, t): self.t = t
    def data_received(self, data): self.parser.feed_data(data)
    def on_body(self, b): self.sink(b)
    def on_message_complete(self): self.done.set_result(None)
    def connection_lost(self, exc):
        if self.done is not None and not self.done.done(): self.done.set_exception(ConnectionError("engine gone"))
        if self in self.pool.idle: self.pool.idle.remove(self)

class Pool:
    def __init__(self, url):
        u = urlsplit(url); self.host, self.port, self.idle = u.hostname, u.port, []
    async def request(self, body, sink):
        c = self.idle.pop() if self.idle else (await asyncio.get_running_loop().create_connection(
            lambda: Upstream(self), self.host, self.port))[1]
        c.sink, c.done = sink, asyncio.get_running_loop().create_future()
        c.t.write(b"POST /v1/completions HTTP/1.1\\r\\nhost: %s\\r\\ncontent-type: application/json\\r\\n"
                  b"content-length: %d\\r\\n\\r\\n%s" % (self.host.encode(), len(body), body))
        await c.done
        c.done = None
        self.idle.append(c)

pp, pd = Pool(P), Pool(D)

class Client(asyncio.Protocol):
    def connection_made(self, t): self.t, self.parser, self.body = t, httptools.HttpRequestParser(self), []
    def data_received(self, data): self.parser.feed_data(data)
    def on_body(self, b): self.body.append(b)
    def on_message_complete(self):
        raw, self.body = b"".join(self.body), []
        asyncio.ensure_future(self.handle(raw))
    async def handle(self, raw):
        b = json.loads(raw)
        p = asyncio.ensure_future(pp.request(json.dumps({{**b, "max_tokens": 1, "stream": False}}).encode(), lambda c: None))
        t = self.t
        t.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n")
        await pd.request(json.dumps(b).encode(), lambda c: t.write(b"%x\\r\\n%s\\r\\n" % (len(c), c)))
        t.write(b"0\\r\\n\\r\\n")
        await p

async def main():
    server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", {port}, backlog=4096)
    await server.serve_forever()

uvloop.run(main())
"""

# uvicorn serving the client as in RELAY, the legs on RAW_RELAY's pooled httptools
# connections: what the engine side's HTTP client costs, apart from the server's
RAW_LEGS_RELAY = """
import asyncio, json
from urllib.parse import urlsplit
import httptools, uvicorn
P, D = {p!r}, {d!r}

class Upstream(asyncio.Protocol):
    def __init__(self, pool):
        self.pool, self.parser = pool, httptools.HttpResponseParser(self)
        self.chunks, self.wake, self.ended = [], None, False
    def connection_made(self, t): self.t = t
    def data_received(self, data):
        self.parser.feed_data(data)
        if self.wake is not None and not self.wake.done(): self.wake.set_result(None)
    def on_body(self, b): self.chunks.append(b)
    def on_message_complete(self): self.ended = True
    def connection_lost(self, exc):
        self.ended = True
        if self.wake is not None and not self.wake.done(): self.wake.set_result(None)
        if self in self.pool.idle: self.pool.idle.remove(self)
    async def body(self):
        while True:
            if self.chunks:
                out, self.chunks = b"".join(self.chunks), []
                yield out
            elif self.ended:
                return
            else:
                self.wake = asyncio.get_running_loop().create_future()
                await self.wake

class Pool:
    def __init__(self, url):
        u = urlsplit(url); self.host, self.port, self.idle = u.hostname, u.port, []
    async def post(self, body):
        c = self.idle.pop() if self.idle else (await asyncio.get_running_loop().create_connection(
            lambda: Upstream(self), self.host, self.port))[1]
        c.chunks, c.ended = [], False
        c.t.write(b"POST /v1/completions HTTP/1.1\\r\\nhost: %s\\r\\ncontent-type: application/json\\r\\n"
                  b"content-length: %d\\r\\n\\r\\n%s" % (self.host.encode(), len(body), body))
        return c
    def done(self, c): self.idle.append(c)

pp, pd = Pool(P), Pool(D)

async def p_leg(body):
    c = await pp.post(body)
    async for _ in c.body(): pass
    pp.done(c)

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({{"type": "lifespan.startup.complete"}})
        await send({{"type": "lifespan.shutdown.complete"}})
        return
    body, more = b"", True
    while more:
        m = await receive()
        body, more = body + m.get("body", b""), m.get("more_body", False)
    b = json.loads(body)
    p = asyncio.ensure_future(p_leg(json.dumps({{**b, "max_tokens": 1, "stream": False}}).encode()))
    c = await pd.post(json.dumps(b).encode())
    await send({{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}})
    async for chunk in c.body():
        await send({{"type": "http.response.body", "body": chunk, "more_body": True}})
    await send({{"type": "http.response.body", "body": b"", "more_body": False}})
    pd.done(c)
    await p

uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", backlog=4096, proxy_headers=False)
"""

# nginx as the relay (placeholders @...@: nginx's own syntax uses braces and dollars)
NGINX_CONF = """
daemon off; master_process off; worker_processes 1; error_log stderr warn; pid @WD@/nginx.pid;
@MODULES@
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path @WD@/body; proxy_temp_path @WD@/proxy; fastcgi_temp_path @WD@/fcgi;
  uwsgi_temp_path @WD@/uwsgi; scgi_temp_path @WD@/scgi;
  client_body_buffer_size 64k;
  upstream p { server @P@; keepalive 512; }
  upstream d { server @D@; keepalive 512; }
  server {
    listen 127.0.0.1:@PORT@ backlog=4096;
    location = /v1/completions {
      @P_LEG@
      proxy_pass http://d; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off;
    }
    location = /_p {
      internal; proxy_pass http://p/v1/completions; proxy_http_version 1.1; proxy_set_header Connection "";
    }
  }
}
"""
NGINX_P_LEG = """access_by_lua_block {
        ngx.req.read_body()
        local cjson = require "cjson.safe"
        local b = cjson.decode(ngx.req.get_body_data())
        b.max_tokens = 1; b.stream = false
        ngx.location.capture("/_p", {method = ngx.HTTP_POST, body = cjson.encode(b)})
      }"""
NGINX_MODULES = "/usr/lib/nginx/modules"


def nginx_command(stack: str, p: str, d: str, port: int, workdir: str) -> list[str] | None:
    """nginx as the floor relay; None when nginx or (for the P/D relay) its Lua module is missing."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    lua = os.path.join(NGINX_MODULES, "ngx_http_lua_module.so")
    if nginx is None or (stack == "nginx" and not os.path.exists(lua)):
        return None
    wd = os.path.join(workdir, stack)
    os.makedirs(wd)
    modules = (f"load_module {NGINX_MODULES}/ndk_http_module.so; load_module {lua};" if stack == "nginx" else "")
    conf = (NGINX_CONF.replace("@MODULES@", modules).replace("@P_LEG@", NGINX_P_LEG if stack == "nginx" else "")
            .replace("@WD@", wd).replace("@P@", p.split("//", 1)[1]).replace("@D@", d.split("//", 1)[1])
            .replace("@PORT@", str(port)))
    with open(os.path.join(wd, "nginx.conf"), "w") as f:
        f.write(conf)
    return [nginx, "-p", wd, "-c", os.path.join(wd, "nginx.conf")]


def relay_command(stack: str, p: str, d: str, port: int, workdir: str) -> list[str] | None:
    """How to run the floor relay on ``stack``; None when that server is not installed."""
    if stack == "uvicorn":
        return [sys.executable, "-c", RELAY.format(p=p, d=d, port=port)]
    if stack == "aiohttp":
        return [sys.executable, "-c", AIOHTTP_RELAY.format(p=p, d=d, port=port)]
    if stack == "raw":
        return [sys.executable, "-c", RAW_RELAY.format(p=p, d=d, port=port)]
    if stack == "raw-legs":
        return [sys.executable, "-c", RAW_LEGS_RELAY.format(p=p, d=d, port=port)]
    if stack.startswith("nginx"):
        return nginx_command(stack, p, d, port, workdir)
    granian = shutil.which("granian", path=os.path.dirname(sys.executable))
    if granian is None:
        return None
    with open(os.path.join(workdir, "granian_relay.py"), "w") as f:
        f.write(GRANIAN_RELAY.format(p=p, d=d))
    return [granian, "--interface", "rsgi", "--port", str(port), "--loop", "uvloop", "--runtime-threads", "1",
            "--log-level", "warning", "--backlog", "4096", "--working-dir", workdir, "granian_relay:app"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--requests-per-stream", type=int, default=10)
    ap.add_argument("--stacks", nargs="+", choices=["uvicorn", "aiohttp", "granian", "raw", "raw-legs", "nginx", "nginx-1leg"], default=["uvicorn"],
                    help="servers to run the floor relay on (uvicorn: the stack kvpath proxy runs on)")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="kvpath-floor-")
    procs: list[subprocess.Popen] = []
    try:
        url = {}
        for role in ("P", "D"):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-c", STUB.format(delay=0.2, tok=0.01, name=role,
                                                                             port=port)]))
            url[role] = f"http://127.0.0.1:{port}"
        servers: dict[str, tuple[str, psutil.Process]] = {}
        for stack in args.stacks:
            port = free_port()
            cmd = relay_command(stack, url["P"], url["D"], port, workdir)
            if cmd is None:
                how = ("apt-get install nginx libnginx-mod-http-lua lua-cjson" if stack.startswith("nginx")
                       else f"pip install {stack}")
                Console().print(f"[yellow]{stack}: not installed ({how}), left out[/yellow]")
                continue
            procs.append(subprocess.Popen(cmd))
            servers[f"floor relay, {stack}"] = (f"http://127.0.0.1:{port}", psutil.Process(procs[-1].pid))
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port", str(port),
             "--prefill", f"{url['P']},kv_addr=127.0.0.1:{KV_SIDE_CHANNEL_PORT}", "--decode", url["D"]]))
        servers["kvpath proxy"] = (f"http://127.0.0.1:{port}", psutil.Process(procs[-1].pid))
        wait_http(url["P"])
        wait_http(url["D"])
        wait_http(servers["kvpath proxy"][0] + "/health")
        time.sleep(3.0)  # the relays have no /health: give them the time to listen
        for u, _ in servers.values():
            uvloop.run(run_streams(u, 8, 1, args.tokens))  # warm connections
        spread = 0.2 + args.tokens * 0.01
        cpu: dict[str, list[float]] = {k: [] for k in servers}
        kernel: dict[str, list[float]] = {k: [] for k in servers}
        errors = dict.fromkeys(servers, 0)
        for r in range(args.rounds):
            order = list(servers)[r % len(servers):] + list(servers)[:r % len(servers)]
            for name in order:
                u, proc = servers[name]
                c0, k0 = cpu_split_s([proc])
                _, e2e, err = uvloop.run(run_streams(u, args.streams, args.requests_per_stream, args.tokens, spread))
                c1, k1 = cpu_split_s([proc])
                cpu[name].append((c1 - c0) * 1e3 / max(1, len(e2e)))
                kernel[name].append((k1 - k0) * 1e3 / max(1, len(e2e)))
                errors[name] += err
        t = Table(title=f"CPU per streamed request, {args.streams} streams, {args.tokens} tokens each, "
                        f"{args.rounds} rounds alternating")
        for col in ("server", "CPU ms/request: median (range)", "of it kernel (system) time", "errors"):
            t.add_column(col)
        for name, v in cpu.items():
            k = kernel[name]
            t.add_row(name, f"{np.median(v):.2f} ({min(v):.2f}..{max(v):.2f})",
                      f"{np.median(k):.2f} ({min(k):.2f}..{max(k):.2f})", str(errors[name]))
        Console(width=130).print(t)
        for name in servers:
            if name != "kvpath proxy":
                ratio = np.median(cpu["kvpath proxy"]) / np.median(cpu[name])
                Console().print(f"[bold]summary[/bold] kvpath proxy / {name}: {ratio:.2f}x")
    finally:
        terminate(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
