"""Where the kill -9 campaign (``campaign``) kills its writer: the kill points, and the
storage wrapper that SIGKILLs its own process at the Nth call of one of them."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.storage.wrapper import StorageWrapper

KILL_POINTS = (
    "staging",
    "open_writer",
    "mid_write",
    "close",
    "before_manifest",
    "after_manifest",
    "retention",
    "random_time",
)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingStorage(StorageWrapper):
    """A storage wrapper that SIGKILLs its own process at the ``n``-th call of kill point ``point``."""

    def __init__(self, inner: Any, point: str, n: int, after_bytes: int = 0) -> None:
        super().__init__(inner)
        self.point = point
        self.n = n
        self.after_bytes = after_bytes
        self._count = 0
        self._lock = threading.Lock()

    def _hit(self, point: str) -> bool:
        if point != self.point:
            return False
        with self._lock:
            self._count += 1
            return self._count == self.n

    def open_writer(self, path: str) -> Any:
        if self._hit("open_writer"):
            kill_self()
        return _KillingWriter(self, path, self.inner.open_writer(path))

    def put_if_absent(self, path: str, data: bytes) -> None:
        manifest = path.endswith("manifest.json")
        if manifest and self._hit("before_manifest"):
            kill_self()
        self.inner.put_if_absent(path, data)
        if manifest and self._hit("after_manifest"):
            kill_self()

    def delete(self, path: str) -> None:
        if self._hit("retention"):
            kill_self()
        self.inner.delete(path)

    def delete_dir(self, path: str) -> None:
        if self._hit("retention"):
            kill_self()
        self.inner.delete_dir(path)

    # everything else passes through (explicit, so that the Storage protocol is met)
    def list_dir(self, path: str) -> list[str]:
        return list(self.inner.list_dir(path))

    def exists(self, path: str) -> bool:
        return bool(self.inner.exists(path))

    def size(self, path: str) -> int:
        return int(self.inner.size(path))

    def mtime(self, path: str) -> float:
        return float(self.inner.mtime(path))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.inner.read_bytes(path))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return bytes(self.inner.read_range(path, offset, length))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(path, offset, buffer)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def put(self, path: str, data: bytes) -> None:
        self.inner.put(path, data)


class _KillingWriter:
    def __init__(self, owner: KillingStorage, path: str, inner: Any) -> None:
        self._owner = owner
        self._inner = inner
        self._written = 0
        self._armed = owner.point == "mid_write" and owner._hit("mid_write")

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._armed and self._written + len(view) > self._owner.after_bytes:
            room = max(0, self._owner.after_bytes - self._written)
            if room:
                self._inner.write(view[:room])
            kill_self()
        self._inner.write(view)
        self._written += len(view)

    def close(self) -> None:
        if self._owner._hit("close"):
            kill_self()
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


def check_points(points: Sequence[str]) -> None:
    """Refuse a kill point that is none of ``KILL_POINTS`` (before any writer starts)."""
    bad = set(points) - set(KILL_POINTS)
    if bad:
        raise ValueError(f"unknown kill point(s) {sorted(bad)}; choose from {', '.join(KILL_POINTS)}")


__all__ = ["KILL_POINTS", "KillingStorage", "check_points", "kill_self"]
