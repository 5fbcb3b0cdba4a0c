"""Storage on any fsspec URL: ``s3://``, ``gs://``, and the rest (``memory://`` for tests).

What the commit protocol relies on, per backend:

- **put_if_absent** is one conditional PUT on S3 (``If-None-Match: *``, through s3fs
  ``pipe_file(..., mode="create")``) and on GCS (``ifGenerationMatch=0``, which gcsfs sends on
  both its one-shot ``uploadType=multipart`` upload and its resumable upload). The store
  answers "412 Precondition Failed" to every writer but the first, and that becomes
  :class:`CommitConflictError`. Other fsspec backends have no such primitive: there,
  ``put_if_absent`` checks and writes under a process-local lock, says so once in the log, and
  ``capabilities.atomic_put_if_absent`` is ``False`` so that callers can tell.
- **Writers** stream through ``fs.open(path, "wb", block_size=part_size_bytes)``: on S3 every
  full block becomes one part of a multipart upload, so memory stays bounded, and the object
  appears only when ``close()`` completes the upload. ``abort()`` aborts the multipart upload
  (or the GCS resumable session): nothing appears, and no parts are left to pay for.
- **Listings are never cached** on S3 and GCS (``use_listings_cache=False`` unless the caller
  says otherwise): other ranks and other processes write the same bucket, so a listing cached
  by this process would be stale in ways :meth:`fs.invalidate_cache` cannot fix. The
  per-process cache is still invalidated after every write and delete here, for backends and
  callers that keep it on.
- **Errors** are translated: missing -> :class:`CheckpointNotFoundError` (also a
  ``FileNotFoundError``), precondition failure or an existing object ->
  :class:`CommitConflictError` (also a ``FileExistsError``), anything else ->
  :class:`StorageError` (also an ``OSError``). The backend's exception is kept as
  ``__cause__`` and the message names the full URL.

This module imports neither torch nor a backend library: fsspec loads ``s3fs`` or ``gcsfs``
when a URL asks for it. Layering: the generic store; what only S3 and GCS need (errors, zonal
buckets, leftover folders) is in storage/object_stores.py, the writer in storage/fsspec_writer.py,
the non-atomic ``put_if_absent`` in storage/unatomic_put.py, and the reading of modification
times in storage/stamps.py.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
import fsspec.core

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    StorageError,
)
from shardkeeper.core.storage.base import Capabilities
from shardkeeper.core.storage.fsspec_writer import FsspecWriter
from shardkeeper.core.storage.object_stores import (
    CONFLICT_RETRIES,
    GCS_PROTOCOLS,
    OBJECT_STORE_PROTOCOLS,
    S3_PROTOCOLS,
    bucket_exists,
    is_conditional_conflict,
    is_precondition_failure,
    is_zonal_bucket,
    remove_empty_folders,
)
from shardkeeper.core.storage.stamps import stamp_of, timestamp
from shardkeeper.core.storage.unatomic_put import put_checked

log = logging.getLogger(__name__)

T = TypeVar("T")

_LOCAL_PROTOCOLS = frozenset({"file", "local"})
_VOLATILE_PROTOCOLS = frozenset({"memory"})

#: Default size of one multipart-upload part. S3 allows 10,000 parts (so files up to ~312 GiB
#: at this size) and needs at least 5 MiB; GCS needs a multiple of 256 KiB. Each open writer
#: buffers at most about one part.
DEFAULT_PART_SIZE_BYTES = 32 * 2**20


def _protocol_of(fs: Any) -> str:
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else str(proto)


class FsspecStorage:
    """A checkpoint root at an fsspec URL.

    ``FsspecStorage("s3://bucket/run-42", client_kwargs={"endpoint_url": ...})``: keyword
    arguments are fsspec storage options, passed to ``fsspec.core.url_to_fs``. Two are ours:

    - ``part_size_bytes``: size of one multipart-upload part (and of a writer's buffer).
    - ``conditional_writes``: ``None`` (default) trusts the backend's kind (S3 and GCS have
      conditional writes); ``False`` forces the non-atomic fallback, for S3-compatible stores
      that ignore ``If-None-Match``; ``True`` asserts that ``pipe_file(mode="create")`` is
      atomic on some other backend.
    - ``client_retries``: on S3, the attempts s3fs and botocore each make before an error
      reaches shardkeeper (``None``, the default, keeps theirs: about 25 attempts over 15 s
      against an unreachable endpoint, in silence). The CLI sets 1 and retries in
      ``RetryingStorage``, which says what it is waiting for. Other backends ignore it.
    """

    def __init__(
        self,
        url: str,
        *,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        conditional_writes: bool | None = None,
        client_retries: int | None = None,
        **storage_options: Any,
    ) -> None:
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        if protocol in OBJECT_STORE_PROTOCOLS:
            storage_options.setdefault("use_listings_cache", False)
        if client_retries is not None:
            if client_retries < 1:
                raise ValueError(f"client_retries must be >= 1, got {client_retries}")
            if protocol in S3_PROTOCOLS:
                config = dict(storage_options.get("config_kwargs") or {})
                config.setdefault("retries", {"max_attempts": client_retries - 1})  # botocore: retries only
                storage_options["config_kwargs"] = config
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            extra = "s3" if protocol in S3_PROTOCOLS else "gcs" if protocol in GCS_PROTOCOLS else None
            hint = f"; install shardkeeper-core[{extra}]" if extra else ""
            raise StorageError(f"cannot open {url}: {e}{hint}") from e
        if client_retries is not None and protocol in S3_PROTOCOLS and hasattr(fs, "retries"):
            fs.retries = client_retries  # s3fs's own loop around every call
        self.fs = fs
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")
        self.protocol = _protocol_of(fs)
        self._object_store = self.protocol in OBJECT_STORE_PROTOCOLS
        if part_size_bytes < 5 * 2**20 and self.protocol in S3_PROTOCOLS:
            raise ValueError(f"part_size_bytes={part_size_bytes}: S3 parts are at least 5 MiB")
        self.part_size_bytes = part_size_bytes
        atomic = self._object_store if conditional_writes is None else conditional_writes
        self._capabilities = Capabilities(
            atomic_put_if_absent=atomic,
            ranged_read=True,
            durable_writes=self.protocol not in _LOCAL_PROTOCOLS | _VOLATILE_PROTOCOLS,
            directories=self.protocol in _LOCAL_PROTOCOLS,
            remote=self.protocol not in _LOCAL_PROTOCOLS | _VOLATILE_PROTOCOLS,
        )
        # gcsfs writes to zonal (Rapid) buckets over gRPC and ignores mode="create" there
        # (it overwrites): ask once, lazily, whether this bucket is one.
        self._zonal_check_pending = (
            conditional_writes is None
            and self.protocol in GCS_PROTOCOLS
            and callable(getattr(fs, "_is_zonal_bucket", None))
        )
        self._caps_lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        if self._zonal_check_pending:
            self._check_zonal_bucket()
        return self._capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        """Override what the backend is trusted with (e.g. a store known to ignore preconditions)."""
        with self._caps_lock:
            self._capabilities = value
            self._zonal_check_pending = False

    def _check_zonal_bucket(self) -> None:
        with self._caps_lock:
            if not self._zonal_check_pending:
                return
            bucket = self.root.split("/", 1)[0]
            if is_zonal_bucket(self.fs, bucket):
                log.warning(
                    "gs://%s is a zonal bucket: gcsfs cannot make conditional writes to it, so "
                    "put_if_absent on %s is not atomic across processes",
                    bucket,
                    self.url,
                )
                self._capabilities = dataclasses.replace(self._capabilities, atomic_put_if_absent=False)
            self._zonal_check_pending = False

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def bucket_exists(self) -> bool | None:
        """Whether the root's bucket exists (object stores; None elsewhere, or when the store
        did not answer): a missing bucket is a typo to report, not an empty root."""
        if self.protocol not in OBJECT_STORE_PROTOCOLS:
            return None
        return bucket_exists(self.fs, self.root.split("/", 1)[0])

    # -- paths and errors -------------------------------------------------------------------

    def _full(self, path: str) -> str:
        path = path.strip("/")
        return f"{self.root}/{path}" if path else self.root

    def describe(self, path: str) -> str:
        path = path.strip("/")
        return f"{self.url}/{path}" if path else self.url

    def _translate(self, op: str, path: str, e: BaseException) -> CheckpointError:
        where = self.describe(path)
        if isinstance(e, CheckpointError):
            return e
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{where} does not exist ({op})")
        if isinstance(e, FileExistsError) or is_precondition_failure(e):
            return CommitConflictError(f"{where} already exists ({op}: the store refused to replace it)")
        detail = str(e) or type(e).__name__
        return StorageError(f"{op} failed on {where}: {type(e).__name__}: {detail}")

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:
            raise self._translate(op, path, e) from e

    def _invalidate(self, path: str) -> None:
        full = self._full(path)
        try:
            self.fs.invalidate_cache(full)
            parent = full.rsplit("/", 1)[0] if "/" in full else ""
            if parent:
                self.fs.invalidate_cache(parent)
        except Exception:  # pragma: no cover - a cache is never worth failing for
            pass

    def _info(self, path: str) -> dict[str, Any]:
        full = self._full(path)
        self.fs.invalidate_cache(full)
        return self._call("info", path, lambda: self.fs.info(full))

    # -- reading ----------------------------------------------------------------------------

    def list_dir(self, path: str) -> list[str]:
        full = self._full(path)
        self._invalidate(path)
        try:
            entries = self.fs.ls(full, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:
            raise self._translate("list", path, e) from e
        names = set()
        for entry in entries:
            name = (entry if isinstance(entry, str) else entry["name"]).rstrip("/")
            if name == full:  # ``path`` is a file: ls() answers with the file itself
                continue
            names.add(name.rsplit("/", 1)[-1])
        return sorted(names)

    def exists(self, path: str) -> bool:
        try:
            self._info(path)
        except CheckpointNotFoundError:
            return False
        return True

    def size(self, path: str) -> int:
        info = self._info(path)
        return int(info.get("size") or 0)

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory: a prefix with objects under it, or a folder marker."""
        try:
            return self._info(path).get("type") == "directory"
        except CheckpointNotFoundError:
            return False

    def mtime(self, path: str) -> float:
        info = self._info(path)
        stamp = stamp_of(info)
        if stamp is not None:
            return stamp
        full = self._full(path)
        if info.get("type") == "directory" and self.protocol in OBJECT_STORE_PROTOCOLS:
            # A folder marker (a zero-byte ``path/`` object) carries the time a prefix has not.
            # (``ls`` hides it on GCS; ``find`` lists it, as the object ``path/``.)
            found = self._call("mtime", path, lambda: self.fs.find(full, maxdepth=1, withdirs=True, detail=True))
            marker = found.get(full + "/") if isinstance(found, dict) else None
            stamp = stamp_of(marker) if isinstance(marker, dict) else None
            if stamp is not None:
                return stamp
        return self._call("mtime", path, lambda: timestamp(self.fs.modified(full)))

    def read_bytes(self, path: str) -> bytes:
        full = self._full(path)
        return bytes(self._call("read", path, lambda: self.fs.cat_file(full)))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        if length == 0:
            return b""
        full = self._full(path)
        data = self._call("read", path, lambda: self.fs.cat_file(full, start=offset, end=offset + length))
        if len(data) != length:
            raise StorageError(
                f"{self.describe(path)} is shorter than expected: wanted bytes "
                f"[{offset}, {offset + length}), got {len(data)}"
            )
        return bytes(data)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        if len(view) == 0:
            return
        view[:] = self.read_range(path, offset, len(view))

    # -- writing ----------------------------------------------------------------------------

    def open_writer(self, path: str) -> FsspecWriter:
        # Best effort "must not exist yet" (a HEAD): names are unique per save attempt, so a
        # hit means two writers share an attempt id. Data files are not written with a
        # precondition on purpose: S3-compatible stores disagree on conditional multipart
        # completion, and the manifest's conditional PUT is the commit point anyway.
        full = self._full(path)
        if self.exists(path):
            raise CommitConflictError(
                f"{self.describe(path)} already exists; file names are unique per save attempt, "
                f"so another writer is using this attempt id"
            ) from FileExistsError(errno.EEXIST, "object exists", full)

        def _open() -> Any:
            if self.capabilities.directories and "/" in full:
                self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
            return self.fs.open(full, "wb", block_size=self.part_size_bytes)

        return FsspecWriter(self, path, self._call("open", path, _open))

    def sync_dir(self, path: str) -> None:
        """Nothing to do: an object is durable when its upload completes."""

    def put_if_absent(self, path: str, data: bytes) -> None:
        full = self._full(path)
        if self.capabilities.atomic_put_if_absent:
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    self.fs.pipe_file(full, data, mode="create")
                    break
                except Exception as e:
                    if is_conditional_conflict(e) and attempt < CONFLICT_RETRIES:
                        time.sleep(0.05 * 2**attempt)
                        continue
                    raise self._translate("put_if_absent", path, e) from e
            self._invalidate(path)
            return
        put_checked(
            self.protocol,
            self.url,
            self.describe(path),
            full,
            lambda: self.exists(path),
            lambda: self._call("put_if_absent", path, lambda: self.fs.pipe_file(full, data)),
        )
        self._invalidate(path)

    def put(self, path: str, data: bytes) -> None:
        full = self._full(path)
        if self.capabilities.directories and "/" in full:
            self._call("put", path, lambda: self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True))
        self._call("put", path, lambda: self.fs.pipe_file(full, data))
        self._invalidate(path)

    def delete(self, path: str) -> None:
        full = self._full(path)
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._translate("delete", path, e) from e
        finally:
            self._invalidate(path)

    def delete_dir(self, path: str) -> None:
        full = self._full(path)
        if full == self.root:
            raise StorageError(f"refusing to delete the checkpoint root {self.url}")
        try:
            try:
                self.fs.rm(full, recursive=True)
            except FileNotFoundError:
                pass
            if self.protocol in S3_PROTOCOLS:
                remove_empty_folders(self.fs, full, self.root.split("/", 1)[0])
        except FileNotFoundError:  # e.g. no such bucket: nothing to delete
            pass
        except Exception as e:
            raise self._translate("delete_dir", path, e) from e
        finally:
            self._invalidate(path)
            self.fs.invalidate_cache(full)


__all__ = ["DEFAULT_PART_SIZE_BYTES", "FsspecStorage"]
