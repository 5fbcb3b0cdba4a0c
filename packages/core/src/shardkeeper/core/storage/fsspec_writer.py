"""Streaming uploads to an fsspec URL (``FsspecWriter``), and how an abandoned one is
discarded on each backend: s3fs aborts the multipart upload, gcsfs cancels the resumable
session, and backends that create the file at open (``memory://``, ``file://``) remove it.

Layering: below the store (storage/fsspec_store.py), which opens writers; it reaches the
store only through ``WriterRoot``, what a writer uses of it, so it need not import it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import fsspec.spec

from shardkeeper.core.errors import CheckpointError, StorageError

log = logging.getLogger(__name__)


class WriterRoot(Protocol):
    """What a writer uses of its store (an ``FsspecStorage``)."""

    fs: Any
    _object_store: bool

    def describe(self, path: str) -> str: ...

    def _full(self, path: str) -> str: ...

    def _translate(self, op: str, path: str, e: BaseException) -> CheckpointError: ...

    def _invalidate(self, path: str) -> None: ...


class FsspecWriter:
    """A streaming upload. Not thread-safe: one writer is fed by one thread."""

    def __init__(self, storage: WriterRoot, path: str, f: Any) -> None:
        self._storage = storage
        self._path = path
        self._f = f
        self._state = "open"  # -> "closed" | "aborted"

    def write(self, data: memoryview | bytes) -> None:
        if self._state != "open":
            raise StorageError(f"write to {self._storage.describe(self._path)} after {self._state}")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        try:
            self._f.write(view)
        except Exception as e:
            raise self._storage._translate("write", self._path, e) from e

    def close(self) -> None:
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise StorageError(f"close of {self._storage.describe(self._path)} after abort()")
        self._state = "closed"
        try:
            self._f.close()
        except Exception as e:
            # Do not leave a half-finished multipart upload behind.
            self._discard_quietly()
            raise self._storage._translate("close", self._path, e) from e
        finally:
            self._storage._invalidate(self._path)

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            self._discard_quietly()
        finally:
            self._storage._invalidate(self._path)

    def _discard_quietly(self) -> None:
        f = self._f
        discard = getattr(f, "discard", None)
        discarded = False
        if callable(discard) and isinstance(f, fsspec.spec.AbstractBufferedFile):
            try:
                discard()  # s3fs: abort the multipart upload; gcsfs: cancel the resumable session
                discarded = True
            except Exception as e:  # pragma: no cover - best effort
                log.debug("discard of %s failed: %s", self._storage.describe(self._path), e)
            finally:
                # Without this, the file's __del__ would close() it: gcsfs would then upload a
                # small file whose discard() had nothing to cancel.
                try:
                    f.closed = True
                except Exception:  # pragma: no cover
                    pass
        if discarded and self._storage._object_store:
            return  # the object only appears on a completed upload, and this one never will
        if not discarded:
            try:
                f.close()
            except Exception:
                pass
        # Backends that create the file at open or write through (memory://, file://, ...).
        try:
            self._storage.fs.rm_file(self._storage._full(self._path))
        except FileNotFoundError:
            pass
        except Exception as e:  # pragma: no cover - best effort; gc removes leftovers
            log.warning("could not remove aborted %s: %s", self._storage.describe(self._path), e)


__all__ = ["FsspecWriter", "WriterRoot", "log"]
