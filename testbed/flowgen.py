"""Bulk TCP flows with chosen source ports, for checking a fabric (paths, rates).

Run inside a host namespace (``ip netns exec <ns> python -m kvpath.testbed.flowgen ...``):

    serve --bind IP --port P --count N       accept N connections, drain each, print JSON
    send --dst IP --port P --bind IP --sports 41000,41001 --bytes B
                                             one connection per source port, all at once;
                                             prints one JSON line per flow (start, end, bytes)

The sender binds each socket to its source port before connecting, so the 5-tuple is
known in advance and a path oracle can be asked about it.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time

CHUNK = 256 * 1024
logger = logging.getLogger(__name__)


def serve(bind: str, port: int, count: int, timeout_s: float) -> list[dict]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(max(16, count))
    srv.settimeout(timeout_s)
    out: list[dict] = []
    lock = threading.Lock()

    def drain(c: socket.socket, peer: tuple[str, int]) -> None:
        n = 0
        t0 = time.time()
        with c:
            while True:
                b = c.recv(CHUNK)
                if not b:
                    break
                n += len(b)
        with lock:
            out.append({"src_ip": peer[0], "src_port": peer[1], "bytes": n, "first_s": t0, "end_s": time.time()})

    threads = []
    for _ in range(count):
        c, peer = srv.accept()
        t = threading.Thread(target=drain, args=(c, peer), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout_s)
    srv.close()
    return out


def send(dst: str, port: int, bind: str, sports: list[int], nbytes: int, timeout_s: float) -> list[dict]:
    out: list[dict] = [{} for _ in sports]
    payload = memoryview(bytearray(CHUNK))
    barrier = threading.Barrier(len(sports))

    def one(i: int, sport: int) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.settimeout(timeout_s)
        s.bind((bind, sport))
        s.connect((dst, port))
        barrier.wait(timeout_s)
        t0 = time.time()
        left = nbytes
        while left > 0:
            left -= s.send(payload[: min(CHUNK, left)])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the receiver closes once it has every byte: FCT ends at delivery, not at send
        out[i] = {"src_ip": bind, "src_port": sport, "dst_ip": dst, "dst_port": port, "bytes": nbytes,
                  "start_s": t0, "end_s": time.time()}
        s.close()

    threads = [threading.Thread(target=one, args=(i, sp), daemon=True) for i, sp in enumerate(sports)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpath.testbed.flowgen")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--timeout-s", type=float, default=60)
    c = sub.add_parser("send")
    c.add_argument("--dst", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--bind", required=True)
    c.add_argument("--sports", required=True, help="comma-separated source ports")
    c.add_argument("--bytes", type=int, required=True)
    c.add_argument("--timeout-s", type=float, default=60)
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        rows = serve(a.bind, a.port, a.count, a.timeout_s)
    else:
        try:
            sports = [int(x) for x in a.sports.split(",") if x]
        except ValueError:
            ap.error(f"--sports must be comma-separated integers, got {a.sports!r}")
        rows = send(a.dst, a.port, a.bind, sports, a.bytes, a.timeout_s)
    for r in rows:
        sys.stdout.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
