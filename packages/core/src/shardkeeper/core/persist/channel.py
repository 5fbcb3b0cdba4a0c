"""The private channel between a trainer and its persist process: framed messages over a
socket pair that only the two hold, with file descriptors passed alongside (``SCM_RIGHTS``).

A message is a kind and a payload of plain data and the core's own records (a save plan, its
groups, a retention policy), as JSON (``records.py``: no pickle). A tensor in a payload goes as
None: the bytes travel through the staging buffer in shared memory, never here. Nothing of
this reaches the on-storage format.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from typing import Any

from shardkeeper.core import errors, metrics
from shardkeeper.core.errors import PersistChannelClosed
from shardkeeper.core.metrics import LabelKey
from shardkeeper.core.persist.records import dumps, loads

_HEADER = struct.Struct("!Q")
_MAX_FDS = 4


def encode(kind: str, payload: Any) -> bytes:
    """One message's bytes (``TypeError`` for a payload that cannot cross: ``records.py``)."""
    return dumps([kind, payload])


def decode(data: bytes) -> tuple[str, Any]:
    """A message's kind and payload (``ValueError`` for bytes that are not one)."""
    msg = loads(data)
    if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)):
        raise ValueError("a persist message is [kind, payload]")
    return msg[0], msg[1]


def send(sock: socket.socket, kind: str, payload: Any = None, fds: tuple[int, ...] = ()) -> None:
    """Send one message (``fds``: descriptors the other end receives as its own)."""
    data = encode(kind, payload)
    head = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        got = sock.recv(min(n, 1 << 20))
        if not got:
            raise PersistChannelClosed("the other end of the persist channel closed it")
        chunks.append(got)
        n -= len(got)
    return b"".join(chunks)


def recv(sock: socket.socket, deadline: float | None = None) -> tuple[str, Any, list[int]]:
    """The next message: its kind, payload and the descriptors that came with it. With a
    ``deadline`` (``time.monotonic()``): ``TimeoutError`` when none has begun to come by then."""
    if deadline is not None:
        try:
            ready = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]
        except (OSError, ValueError) as e:  # (closed meanwhile)
            raise PersistChannelClosed(str(e)) from e
        if not ready:
            raise TimeoutError("no message from the persist process by the deadline")
    try:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    except (ConnectionResetError, BrokenPipeError) as e:
        raise PersistChannelClosed(str(e)) from e
    if not head:
        for fd in fds:
            _close(fd)
        raise PersistChannelClosed("the other end of the persist channel closed it")
    try:
        if len(head) < _HEADER.size:
            head += _recv_exact(sock, _HEADER.size - len(head))
        (size,) = _HEADER.unpack(head)
        kind, payload = decode(_recv_exact(sock, size))
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    return kind, payload, list(fds)


def error_record(e: BaseException) -> dict[str, Any]:
    """How a save's failure crosses the channel (``rebuilt`` raises it again on the other side)."""
    return {
        "type": type(e).__name__,
        "message": str(e),
        "step": getattr(e, "step", None),
        "failures": getattr(e, "failures", None),
    }


def rebuilt(record: dict[str, Any]) -> errors.CheckpointError:
    """The error ``error_record`` describes: the core's class of that name with its message
    (a save's step and failures kept), else a ``CheckpointSaveError`` with the same message."""
    cls = getattr(errors, str(record.get("type")), None)
    message, step = str(record.get("message")), record.get("step")
    step = step if isinstance(step, int) else -1
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointSaveError
    if issubclass(cls, errors.CheckpointSaveError):
        return cls(message, step=step, failures=record.get("failures") or None)
    try:
        return cls(message)
    except TypeError:
        return errors.CheckpointSaveError(message, step=step)


def counters() -> dict[tuple[str, LabelKey], float]:
    """Every counter of this process's metrics registry, by name and label set."""
    return {(m.name, k): float(v) for m in metrics.REGISTRY if m.kind == "counter" for k, v in m.samples()}


def counted_since(before: dict[tuple[str, LabelKey], float]) -> list[tuple[str, LabelKey, float]]:
    """What the counters grew by since ``before`` (a persist process's share of a save: bytes
    written, errors after a commit), for its trainer to add to its own registry."""
    return [
        (name, k, v - before.get((name, k), 0.0))
        for (name, k), v in counters().items()
        if v > before.get((name, k), 0.0)
    ]


def add_counted(grown: list[tuple[str, LabelKey, float]]) -> None:
    """The trainer's side of ``counted_since``."""
    for name, labels, amount in grown:
        try:
            metrics.REGISTRY[name].inc(amount, **dict(labels))
        except (KeyError, ValueError):  # a counter this process does not have: nothing to add to
            pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


__all__ = [
    "PersistChannelClosed",
    "add_counted",
    "counted_since",
    "counters",
    "decode",
    "encode",
    "error_record",
    "rebuilt",
    "recv",
    "send",
]
