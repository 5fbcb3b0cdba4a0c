"""A fault-injecting HTTP proxy on loopback, in front of a real S3 server (moto).

Clients talk to ``proxy.endpoint`` instead of the server. Each request is read whole, then,
by a seeded draw (or a forced mode), either forwarded and its response relayed, or:

- ``"503"``: answered ``503 Slow Down`` with S3's ``SlowDown`` error body (not forwarded);
- ``"reset"``: the connection is reset (RST) without forwarding;
- ``"reset_after"``: forwarded (the server acts on it), then the connection is reset, so the
  client never sees the reply: a lost response;
- ``"delay"``: held for ``delay_s`` (longer than the client's read timeout), then closed.

``injected`` counts each kind; ``requests`` counts everything seen (``by_method``: by method). Only requests whose method
is in ``methods`` (default: every method) and whose path contains ``path_filter`` are
eligible for faults.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
FAULTS = ("503", "reset", "reset_after", "delay")


class _Closed(Exception):
    pass


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Closed()
    return bytes(data)


def _read_request(f: Any, conn: socket.socket) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = f.readline(65537)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = f.readline(65537)
        if not h:
            raise _Closed()
        if h in (b"\r\n", b"\n"):
            break
        k, v = h.decode("latin-1").split(":", 1)
        headers.append((k.strip(), v.strip()))
    names = {k.lower(): v for k, v in headers}
    if names.get("expect", "").lower() == "100-continue":  # botocore asks before large bodies
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if names.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int(f.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while f.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            body += _read_exact(f, size)
            f.readline()
        headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
        return method, target, headers, bytes(body)
    n = int(names.get("content-length", "0") or 0)
    return method, target, headers, _read_exact(f, n) if n else b""


class FaultProxy:
    """``with FaultProxy(upstream, rate=0.2, seed=1) as p: ... p.endpoint ...``"""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        seed: int = 0,
        delay_s: float = 2.0,
        methods: tuple[str, ...] | None = None,
        path_filter: str = "",
    ) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rate = rate
        self.faults = faults
        self.forced: str | None = None  # a fault for every eligible request
        self.delay_s = delay_s
        self.methods = methods
        self.path_filter = path_filter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.by_method: Counter[str] = Counter()  # every request seen, by HTTP method
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    while proxy._serve_one(self.connection, self.rfile):
                        pass
                except (_Closed, OSError, ValueError):
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _decide(self, method: str, target: str) -> str | None:
        with self._lock:
            self.requests += 1
            self.by_method[method] += 1
            if self.methods is not None and method not in self.methods:
                return None
            if self.path_filter not in target:
                return None
            fault = self.forced
            if fault is None and self._rng.random() < self.rate:
                fault = self._rng.choice(self.faults)
            if fault is not None:
                self.injected[fault] += 1
            return fault

    @staticmethod
    def _reset(conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    def _serve_one(self, conn: socket.socket, rfile: Any) -> bool:
        req = _read_request(rfile, conn)
        if req is None:
            return False
        method, target, headers, body = req
        fault = self._decide(method, target)
        if fault == "503":
            conn.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(SLOW_DOWN)}\r\n\r\n".encode()
                + SLOW_DOWN
            )
            return True
        if fault == "reset":
            self._reset(conn)
            return False
        if fault == "delay":
            time.sleep(self.delay_s)
            conn.close()
            return False
        up = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in ("connection", "expect"):
                    up.putheader(k, v)
            up.putheader("Connection", "close")
            up.endheaders(body)
            resp = up.getresponse()
            data = resp.read()
            out = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode("latin-1")]
            for k, v in resp.getheaders():
                if k.lower() in ("transfer-encoding", "connection", "content-length"):
                    continue
                out.append(f"{k}: {v}\r\n".encode("latin-1"))
            length = resp.getheader("Content-Length") if method == "HEAD" else str(len(data))
            if length is not None:
                out.append(f"Content-Length: {length}\r\n".encode())
            out.append(b"\r\n")
        finally:
            up.close()
        if fault == "reset_after":
            self._reset(conn)
            return False
        conn.sendall(b"".join(out) + (b"" if method == "HEAD" else data))
        return True
