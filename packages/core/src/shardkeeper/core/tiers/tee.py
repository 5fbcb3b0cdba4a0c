"""The bytes a save wrote to the local tier, kept by reference until its replicas are sent.

Replicas would otherwise be read back from the disk right after they were written (with
``O_DIRECT`` they are not even in the page cache), tripling a save's disk traffic. ``Tee``
sits under the encryption (it sees the bytes as stored) and remembers, per file it writes,
the buffers its writer was given, without a copy: the staging buffer (or, encoded, the
chunks' own buffers), which the next save cannot reuse before this one ends (one save in
flight per manager; a synchronous save writes from tensors its caller cannot touch before
it returns). ``read_into`` serves a remembered file from memory; ``forget`` drops them all
once the replicas are sent. A file written in several attempts, or aborted, is not served.
"""

from __future__ import annotations

import threading

from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.storage.wrapper import StorageWrapper


class _TeeWriter:
    def __init__(self, owner: Tee, path: str, inner: Writer) -> None:
        self._owner, self._path, self._inner = owner, path, inner
        self._parts: list[memoryview] = []
        self._size = 0

    def write(self, data: memoryview | bytes) -> None:
        self._inner.write(data)
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self._parts.append(view)
        self._size += len(view)

    def close(self) -> None:
        self._inner.close()
        self._owner._remember(self._path, self._parts, self._size)

    def abort(self) -> None:
        self._parts = []
        self._inner.abort()


class Tee(StorageWrapper):
    """``inner`` (a node's directory, unencrypted), remembering what its writers wrote."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._files: dict[str, tuple[list[memoryview], list[int]]] = {}
        self._lock = threading.Lock()
        self.recording = True

    def open_writer(self, path: str) -> Writer:
        inner = self.inner.open_writer(path)
        return _TeeWriter(self, path, inner) if self.recording else inner

    def _remember(self, path: str, parts: list[memoryview], size: int) -> None:
        starts, pos = [], 0
        for p in parts:
            starts.append(pos)
            pos += len(p)
        with self._lock:
            self._files[path] = (parts, starts)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with self._lock:
            held = self._files.get(path)
        if held is None:
            self.inner.read_into(path, offset, buffer)
            return
        parts, starts = held
        out = buffer.cast("B") if buffer.format != "B" else buffer
        want_end = offset + len(out)
        end = starts[-1] + len(parts[-1]) if parts else 0
        if want_end > end:
            self.inner.read_into(path, offset, buffer)  # (not what was written: let the disk say why)
            return
        pos = offset
        for start, part in zip(starts, parts):
            stop = start + len(part)
            if stop <= pos or start >= want_end:
                continue
            a, b = pos - start, min(len(part), want_end - start)
            out[pos - offset : pos - offset + (b - a)] = part[a:b]
            pos += b - a

    def forget(self) -> None:
        with self._lock:
            self._files.clear()


__all__ = ["Tee"]
