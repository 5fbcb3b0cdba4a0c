"""Fault injection for any :class:`~shardkeeper.core.storage.base.Storage`.

Shipped, not only tested with: wrap your own backend (or ours) to check that a failure at any
point of a save leaves no visible checkpoint, and that corruption is caught on restore.

Example::

    from shardkeeper.core.storage import open_storage
    from shardkeeper.core.testing.faults import FaultyStorage

    inner = open_storage("s3://bucket/run")
    storage = FaultyStorage(
        inner,
        fail_on={
            "open_writer": "*/data/r00001-*",     # rank 1 cannot create its shard file
            "put_if_absent": "*/manifest.json",   # the commit itself fails
        },
    )

    # A torn write: the shard's writer passes 1 MiB through, then fails (once).
    storage = FaultyStorage(inner, fail_on={"write": "*/data/*"}, after_bytes=2**20, times=1)

    # A transient error: the first two reads fail, later ones succeed.
    storage = FaultyStorage(inner, fail_on={"read_range": "*"}, times=2)

    # Silent corruption: reads of shard files come back with one byte flipped.
    storage = FaultyStorage(inner, corrupt="*/data/*")

The knobs:

``fail_on``
    Operation name -> ``fnmatch`` pattern (or a list of patterns) of paths relative to the
    root. Operations are the ``Storage`` methods (``list_dir``, ``exists``, ``size``,
    ``mtime``, ``read_bytes``, ``read_range``, ``read_into``, ``open_writer``, ``sync_dir``,
    ``put_if_absent``, ``put``, ``delete``, ``delete_dir``) and the writer's ``write`` and
    ``close`` (matched on the path the writer was opened for). A call to a listed operation on
    a matching path is a *matching call*. ``fnmatch`` lets ``*`` cross ``/``: ``"*"`` matches
    every path, ``"*/manifest.json"`` every manifest.
``error``
    What a failing call raises: an exception instance (a fresh copy is raised each time), an
    exception class (instantiated with a message), or ``callable(op, path) -> exception``.
    Default ``OSError(EIO, "injected fault")``. It is translated the way backends translate
    theirs: ``FileNotFoundError`` -> ``CheckpointNotFoundError``, ``FileExistsError`` ->
    ``CommitConflictError``, a ``CheckpointError`` as is, anything else -> ``StorageError``;
    the original is the ``__cause__``, the message names the operation and the full path.
``skip`` / ``times``
    The first ``skip`` matching calls succeed; then ``times`` of them fail (``None``: all).
    One counter for the whole wrapper, thread-safe.
``after_bytes``
    A torn write. For ``write``: each matching writer passes its first ``after_bytes`` bytes to
    the inner writer, then the write that crosses the limit fails (the inner writer is left
    open: the caller must ``abort()``, which is what is being tested). For ``put`` and
    ``put_if_absent``: the first ``after_bytes`` bytes are stored through the inner storage
    (as a crash in the middle of a non-atomic write would leave them), then the call fails.
``corrupt`` / ``corrupt_offset``
    Pattern(s) of paths whose reads (``read_bytes``, ``read_range``, ``read_into``) come back
    with one byte inverted: the byte at file offset ``corrupt_offset`` when a read covers it,
    or the first byte of every read when ``corrupt_offset`` is ``None``. Independent of
    ``skip`` / ``times``; the stored bytes are untouched.

``lose``
    Pattern(s) of paths whose writes are *lost while claiming durability*: a matching writer's
    bytes, and a matching ``put`` / ``put_if_absent``, are stored as zeros of the same length,
    and every call succeeds. That is what a power cut leaves of a file whose ``fsync`` lied (a
    disk cache without power-loss protection, a file system that acknowledges early): its
    size, not its bytes. A kill -9 never shows it on a POSIX file system (the page cache
    survives a process kill); this does (docs/reliability.md, "The kill -9 campaign").

``injected`` lists ``(op, path)`` of every fault raised (``("corrupt", path)`` for every
corrupted read, ``("lose", path)`` for every write lost); set ``enabled = False`` to let
everything through.
"""

from __future__ import annotations

import copy
import errno
import fnmatch
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    StorageError,
)
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.storage.wrapper import StorageWrapper

ErrorSpec = BaseException | type[BaseException] | Callable[[str, str], BaseException]

STORAGE_OPS = frozenset(
    {
        "list_dir",
        "exists",
        "size",
        "mtime",
        "read_bytes",
        "read_range",
        "read_into",
        "open_writer",
        "sync_dir",
        "put_if_absent",
        "put",
        "delete",
        "delete_dir",
    }
)
WRITER_OPS = frozenset({"write", "close"})
OPS = STORAGE_OPS | WRITER_OPS


def _patterns(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    if spec is None:
        return ()
    if isinstance(spec, str):
        return (spec,)
    return tuple(spec)


class _FaultyWriter:
    def __init__(self, owner: FaultyStorage, path: str, inner: Writer) -> None:
        self._owner = owner
        self._path = path
        self._inner = inner
        self._written = 0

    def write(self, data: memoryview | bytes) -> None:
        owner = self._owner
        data = owner._lost("write", self._path, data)
        if not owner._matches("write", self._path):
            self._inner.write(data)
            self._written += memoryview(data).nbytes
            return
        if owner.after_bytes is None:
            owner._maybe_fail("write", self._path)
            self._inner.write(data)
            self._written += memoryview(data).nbytes
            return
        view = memoryview(data).cast("B")
        room = owner.after_bytes - self._written
        if len(view) <= room:
            self._inner.write(view)
            self._written += len(view)
            return
        if room > 0:
            self._inner.write(view[:room])
            self._written += room
        owner._maybe_fail("write", self._path)
        self._inner.write(view[max(room, 0) :])
        self._written += len(view) - max(room, 0)

    def close(self) -> None:
        if self._owner._matches("close", self._path):
            try:
                self._owner._maybe_fail("close", self._path)
            except BaseException:
                self._inner.abort()  # a failed completion leaves nothing, like a failed upload
                raise
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class FaultyStorage(StorageWrapper):
    """A ``Storage`` that fails or corrupts chosen operations on chosen paths (see the module)."""

    def __init__(
        self,
        inner: Storage,
        *,
        fail_on: Mapping[str, str | Iterable[str]] | None = None,
        error: ErrorSpec | None = None,
        skip: int = 0,
        times: int | None = None,
        after_bytes: int | None = None,
        corrupt: str | Iterable[str] | None = None,
        corrupt_offset: int | None = None,
        lose: str | Iterable[str] | None = None,
    ) -> None:
        super().__init__(inner)
        self.fail_on = {op: _patterns(p) for op, p in (fail_on or {}).items()}
        unknown = sorted(set(self.fail_on) - OPS)
        if unknown:
            raise ValueError(f"unknown operation(s) {unknown} in fail_on; known: {sorted(OPS)}")
        if skip < 0 or (times is not None and times < 0):
            raise ValueError("skip and times must be >= 0")
        if after_bytes is not None and after_bytes < 0:
            raise ValueError("after_bytes must be >= 0")
        self.error: ErrorSpec = error if error is not None else OSError(errno.EIO, "injected fault")
        self.skip = skip
        self.times = times
        self.after_bytes = after_bytes
        self.corrupt = _patterns(corrupt)
        self.corrupt_offset = corrupt_offset
        self.lose = _patterns(lose)
        self.enabled = True
        self.injected: list[tuple[str, str]] = []
        self._matched = 0
        self._lock = threading.Lock()

    # -- the protocol's attributes ------------------------------------------------------------

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r}, fail_on={self.fail_on!r})"

    # -- the machinery ------------------------------------------------------------------------

    def _matches(self, op: str, path: str) -> bool:
        if not self.enabled:
            return False
        return any(fnmatch.fnmatchcase(path, p) for p in self.fail_on.get(op, ()))

    def _make_error(self, op: str, path: str) -> BaseException:
        spec = self.error
        if isinstance(spec, BaseException):
            return copy.copy(spec)
        if isinstance(spec, type):
            return cast("BaseException", spec(f"injected fault: {op} {path}"))
        return spec(op, path)

    def _translate(self, op: str, path: str, e: BaseException) -> BaseException:
        where = self.inner.describe(path)
        if isinstance(e, CheckpointError):
            return e
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{where} does not exist ({op}, injected)")
        if isinstance(e, FileExistsError):
            return CommitConflictError(f"{where} already exists ({op}, injected)")
        detail = str(e) or type(e).__name__
        return StorageError(f"{op} failed on {where}: {type(e).__name__}: {detail} (injected)")

    def _should_fail(self) -> bool:
        with self._lock:
            self._matched += 1
            n = self._matched - self.skip
            return n >= 1 and (self.times is None or n <= self.times)

    def _maybe_fail(self, op: str, path: str) -> None:
        """Count a matching call; raise the translated fault if its turn has come."""
        if not self._should_fail():
            return
        with self._lock:
            self.injected.append((op, path))
        cause = self._make_error(op, path)
        err = self._translate(op, path, cause)
        if err is cause:
            raise err
        raise err from cause

    def _check(self, op: str, path: str) -> None:
        if self._matches(op, path):
            self._maybe_fail(op, path)

    def _corrupts(self, path: str) -> bool:
        return self.enabled and any(fnmatch.fnmatchcase(path, p) for p in self.corrupt)

    def _corrupt_view(self, path: str, offset: int, view: memoryview) -> None:
        if not self._corrupts(path) or len(view) == 0:
            return
        if self.corrupt_offset is None:
            i = 0
        elif offset <= self.corrupt_offset < offset + len(view):
            i = self.corrupt_offset - offset
        else:
            return
        view[i] ^= 0xFF
        with self._lock:
            self.injected.append(("corrupt", path))

    def _corrupt_bytes(self, path: str, offset: int, data: bytes) -> bytes:
        if not self._corrupts(path):
            return data
        buf = bytearray(data)
        self._corrupt_view(path, offset, memoryview(buf))
        return bytes(buf)

    def _lost(self, op: str, path: str, data: memoryview | bytes) -> memoryview | bytes:
        """``data``, or as many zeros when writes to ``path`` are lost (``lose``)."""
        if not (self.enabled and any(fnmatch.fnmatchcase(path, p) for p in self.lose)):
            return data
        with self._lock:
            self.injected.append(("lose", path))
        return bytes(memoryview(data).nbytes)

    def _torn_put(self, op: str, path: str, data: bytes, put: Callable[[str, bytes], None]) -> None:
        data = bytes(self._lost(op, path, data))
        if not self._matches(op, path):
            put(path, data)
            return
        if self.after_bytes is None or self.after_bytes >= len(data):
            self._maybe_fail(op, path)
            put(path, data)
            return
        if self._should_fail():
            put(path, bytes(data[: self.after_bytes]))
            with self._lock:
                self.injected.append((op, path))
            cause = self._make_error(op, path)
            err = self._translate(op, path, cause)
            if err is cause:
                raise err
            raise err from cause
        put(path, data)

    # -- Storage ------------------------------------------------------------------------------

    def list_dir(self, path: str) -> list[str]:
        self._check("list_dir", path)
        return self.inner.list_dir(path)

    def exists(self, path: str) -> bool:
        self._check("exists", path)
        return self.inner.exists(path)

    def size(self, path: str) -> int:
        self._check("size", path)
        return self.inner.size(path)

    def mtime(self, path: str) -> float:
        self._check("mtime", path)
        return self.inner.mtime(path)

    def read_bytes(self, path: str) -> bytes:
        self._check("read_bytes", path)
        return self._corrupt_bytes(path, 0, self.inner.read_bytes(path))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self._check("read_range", path)
        return self._corrupt_bytes(path, offset, self.inner.read_range(path, offset, length))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self._check("read_into", path)
        self.inner.read_into(path, offset, buffer)
        view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        self._corrupt_view(path, offset, view)

    def open_writer(self, path: str) -> Writer:
        self._check("open_writer", path)
        return _FaultyWriter(self, path, self.inner.open_writer(path))

    def sync_dir(self, path: str) -> None:
        self._check("sync_dir", path)
        self.inner.sync_dir(path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        self._torn_put("put_if_absent", path, data, self.inner.put_if_absent)

    def put(self, path: str, data: bytes) -> None:
        self._torn_put("put", path, data, self.inner.put)

    def delete(self, path: str) -> None:
        self._check("delete", path)
        self.inner.delete(path)

    def delete_dir(self, path: str) -> None:
        self._check("delete_dir", path)
        self.inner.delete_dir(path)


__all__ = ["OPS", "FaultyStorage"]
