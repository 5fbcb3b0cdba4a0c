"""The etcd catalog's one HTTP exchange, bounded in time and size (commit/catalog.py calls it).

``urllib``'s timeout bounds each socket operation, not the call, and it reads an answer of
any size: an endpoint that sends a byte every two seconds holds a commit for minutes, one
that answers gigabytes swells the process by as much. Here one *deadline* covers the whole
request (connect, TLS handshake, send, then the answer read in pieces, each read's socket
timeout the time left), and the answer (status line, headers and body as received) may be
at most ``max_bytes``; past either, the exchange stops and is a :class:`CatalogError` naming
the endpoint, the call and what happened. ``http.client`` parses what was read (status,
headers, ``Content-Length`` or chunked bodies), so only the reads are ours.
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
from urllib.parse import urlsplit

from shardkeeper.core.errors import CatalogError, CatalogReadStopped
from shardkeeper.core.util.sizes import human_size

_UNAFFECTED = "the checkpoints are unaffected (the manifests are the truth)"


class _Bounded(io.RawIOBase):
    """The socket as ``http.client`` reads it: each read waits at most the time left before
    ``deadline``, and all of them together return at most ``cap`` bytes."""

    def __init__(self, sock: socket.socket, deadline: float, cap: int) -> None:
        self.sock, self.deadline, self.cap, self.got = sock, deadline, cap, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CatalogReadStopped("deadline")
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(b, min(len(b), self.cap + 1 - self.got))
        except TimeoutError:
            raise CatalogReadStopped("deadline") from None
        self.got += n
        if self.got > self.cap:
            raise CatalogReadStopped("cap")
        return n


class _Source:
    """What ``HTTPResponse`` reads from: it asks only for ``makefile("rb")``."""

    def __init__(self, raw: _Bounded) -> None:
        self.raw = raw

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self.raw)


def post_json(endpoint: str, path: str, body: bytes, *, deadline: float, max_bytes: int, timeout_s: float) -> bytes:
    """POST ``body`` (JSON) to ``endpoint`` + ``path`` and return the answer's body, all of it
    before ``deadline`` (``time.monotonic()``) and at most ``max_bytes`` of answer.
    ``timeout_s``: the catalog's timeout that set the deadline (for the messages)."""
    call = path.rsplit("/v3/", 1)[-1]
    limit = f"its deadline ({timeout_s:g} s for a call, from connecting to the last byte, and for an update in all)"

    def fail(what: str) -> CatalogError:
        return CatalogError(f"etcd catalog at {endpoint}: {call} {what}; {_UNAFFECTED}")

    url = urlsplit(endpoint)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    sock: socket.socket | None = None
    raw: _Bounded | None = None
    try:
        sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 1e-3))
        if url.scheme == "https":
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))  # (the handshake: one deadline)
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))  # sendall: one deadline for all of it
        sock.sendall(head.encode() + body)
        raw = _Bounded(sock, deadline, max_bytes)
        resp = http.client.HTTPResponse(_Source(raw), method="POST")  # type: ignore[arg-type]
        resp.begin()
        data = resp.read()
    except CatalogReadStopped as e:
        got = raw.got if raw is not None else 0
        if str(e) == "cap":
            what = (
                f"answered more than {max_bytes} bytes ({human_size(max_bytes)}), far more than etcd answers "
                f"to this call (not an etcd endpoint, or a proxy in the way?); stopped reading"
            )
        else:
            what = f"gave no complete answer within {limit}: {got} bytes had come; gave up"
        raise fail(what) from None
    except TimeoutError as e:  # connect, handshake or send past the deadline
        raise fail(f"did not connect or take the request within {limit}: {e}") from e
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise fail(f"failed: {type(e).__name__}: {e}") from e
    finally:
        if sock is not None:
            sock.close()
    if resp.status != 200:
        raise fail(f"answered HTTP {resp.status} {resp.reason}")
    return data


__all__ = ["post_json"]
