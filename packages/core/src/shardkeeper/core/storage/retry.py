"""Retries of transient storage faults: bounded exponential backoff with full jitter.

:class:`RetryingStorage` wraps any :class:`Storage`. A call that fails with a *transient*
error (throttling such as S3 ``503 SlowDown``, other 5xx / 429 / 408 answers, connection
resets and refusals, timeouts) is repeated after ``uniform(0, min(max_delay_s, base_delay_s *
2**(n-1)))`` seconds ("full jitter"), at most ``max_attempts`` times in all and never starting
an attempt past ``deadline_s`` after the first; then a :class:`StorageError` says what failed,
how often and for how long. Everything else (missing file, conflict, corruption, a disk
error) is raised at once.

What is retried, and why it is safe:

- reads, listings, ``size``/``mtime``/``exists``, ``delete``/``delete_dir`` (idempotent);
- ``put`` (a whole-object replace) and ``open_writer``;
- a writer's ``write``/``close``: data file names are unique per save attempt, so the
  writer aborts its upload, opens the same name again and replays the bytes written so far.
  It keeps *references* to them (up to ``MAX_REPLAY_BYTES`` per file), no copies: callers keep the bytes passed to ``write()``
  unchanged until ``close()`` returns (``Writer``'s contract). A ``close()`` whose reply was
  lost may have completed: if the file then exists with exactly the bytes written, it counts
  as done;
- ``put_if_absent`` (the commit): a retry that finds the object already there reads it back;
  if it holds our bytes (the manifest carries this save's attempt id), our earlier attempt
  landed and its reply was lost, so it is a success; otherwise it is a real conflict.

Object-store clients retry on their own too (botocore, s3fs and gcsfs each a few times, part
uploads included); this layer bounds the whole, adds the deadline, counts every error in
``checkpoint_upload_errors_total`` (labels ``op``, ``outcome``) and makes the final message.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from shardkeeper.core import metrics
from shardkeeper.core.errors import CheckpointError, CommitConflictError, StorageError
from shardkeeper.core.storage.base import Storage, Writer, sizes_of
from shardkeeper.core.storage.transient import is_transient, reason
from shardkeeper.core.storage.wrapper import StorageWrapper

log = logging.getLogger(__name__)
#: On the first retry of a call, one INFO record here says what is being waited for and why
#: (``waiting for s3://b/run (connection refused to 127.0.0.1:9000); retrying, attempt 2/5 within 120 s``).
#: A program that waits on a person shows it (the CLI prints it on stderr); the library never prints.
wait_log = logging.getLogger("shardkeeper.core.storage.waiting")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How transient storage faults are retried (per storage call)."""

    max_attempts: int = 5
    """Attempts in all, the first included; 1 disables retries."""
    base_delay_s: float = 0.2
    """The backoff before retry n is uniform(0, min(max_delay_s, base_delay_s * 2**(n-1)))."""
    max_delay_s: float = 10.0
    """Cap of one backoff."""
    deadline_s: float = 120.0
    """No attempt starts later than this after the first one."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"retry max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("base_delay_s", "max_delay_s", "deadline_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"retry {name} must be >= 0, got {getattr(self, name)}")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): full jitter."""
        cap = min(self.max_delay_s, self.base_delay_s * 2 ** (retry - 1))
        return (rng or random).uniform(0.0, cap)


class _Attempts:
    """One retried operation: counts, sleeps, and gives up with a clear error."""

    def __init__(self, owner: RetryingStorage, op: str, path: str) -> None:
        self.owner = owner
        self.op = op
        self.path = path
        self.t0 = time.monotonic()
        self.n = 0

    def failed(self, e: BaseException) -> None:
        """Called with the error of attempt ``self.n``: returns to retry, or raises."""
        owner, policy = self.owner, self.owner.policy
        transient = is_transient(e)
        if not transient:
            if isinstance(e, StorageError) or not isinstance(e, CheckpointError):
                owner._count(self.op, "failed")
            raise e
        elapsed = time.monotonic() - self.t0
        delay = policy.backoff(self.n, owner._rng)
        if self.n >= policy.max_attempts or elapsed + delay > policy.deadline_s:
            owner._count(self.op, "failed")
            raise StorageError(
                f"{self.op} of {owner.describe(self.path)} failed {self.n} time(s) over "
                f"{elapsed:.1f} s with transient errors and was given up (retry policy: "
                f"max_attempts={policy.max_attempts}, deadline_s={policy.deadline_s}); last: "
                f"{type(e).__name__}: {e}. The store is throttling or unreachable: check it, "
                f"or raise retry_max_attempts / retry_deadline_s"
            ) from e
        owner._count(self.op, "retried")
        if self.n == 1:
            wait_log.info(
                "waiting for %s (%s); retrying, attempt %d/%d within %g s",
                owner.url,
                reason(e),
                self.n + 1,
                policy.max_attempts,
                policy.deadline_s,
            )
        log.info(
            "%s of %s: transient error (%s), retry %d in %.2f s",
            self.op,
            owner.describe(self.path),
            e,
            self.n,
            delay,
        )
        time.sleep(delay)

    def run(self, fn: Callable[[], T]) -> T:
        while True:
            self.n += 1
            try:
                return fn()
            except Exception as e:
                self.failed(e)


#: A writer keeps references to at most this many written bytes for a replay; past it (a
#: large file of freshly encoded buffers that nothing else holds) it stops retrying itself and
#: relies on the client's own part retries (s3fs, gcsfs), so memory stays bounded.
MAX_REPLAY_BYTES = 256 << 20


class _RetryingWriter:
    """A writer that, on a transient fault, aborts, reopens the same name and replays."""

    def __init__(self, owner: RetryingStorage, path: str, inner: Writer) -> None:
        self._owner = owner
        self._path = path
        self._inner = inner
        self._parts: list[memoryview | bytes] | None = []
        self._written = 0

    def _reopen_and_replay(self) -> None:
        assert self._parts is not None
        try:
            self._inner.abort()
        except Exception:  # best effort: the old upload is gone or will be aborted by gc
            pass
        self._inner = self._owner.inner.open_writer(self._path)
        for part in self._parts:
            self._inner.write(part)

    def write(self, data: memoryview | bytes) -> None:
        n = memoryview(data).nbytes
        if self._parts is not None and self._written + n > MAX_REPLAY_BYTES:
            self._parts = None  # too much to hold for a replay: no retries at this layer
        if self._parts is None:
            self._inner.write(data)
            self._written += n
            return
        att = _Attempts(self._owner, "write", self._path)
        first = True
        while True:
            att.n += 1
            try:
                if not first:
                    self._reopen_and_replay()
                first = False
                self._inner.write(data)
                break
            except Exception as e:
                att.failed(e)
        self._parts.append(data)
        self._written += n

    def close(self) -> None:
        if self._parts is None:
            self._inner.close()
            return
        att = _Attempts(self._owner, "close", self._path)
        first = True
        while True:
            att.n += 1
            try:
                if not first:
                    if self._landed():
                        break
                    self._reopen_and_replay()
                first = False
                self._inner.close()
                break
            except Exception as e:
                att.failed(e)
        self._parts = []

    def _landed(self) -> bool:
        """A close whose reply was lost may have completed: the file is there, whole."""
        try:
            return self._owner.inner.size(self._path) == self._written
        except CheckpointError:
            return False

    def abort(self) -> None:
        self._parts = []
        self._inner.abort()


class RetryingStorage(StorageWrapper):
    """``inner`` with transient faults retried under ``policy`` (see the module docstring)."""

    def __init__(self, inner: Storage, policy: RetryPolicy | None = None, *, seed: int | None = None) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.retries = 0
        """Transient errors retried by this wrapper (all operations)."""
        self.failures = 0
        """Operations that failed for good (transient errors exhausted, or another StorageError)."""

    def __repr__(self) -> str:
        return f"RetryingStorage({self.inner!r}, {self.policy})"

    def _count(self, op: str, outcome: str) -> None:
        with self._lock:
            if outcome == "retried":
                self.retries += 1
            else:
                self.failures += 1
        metrics.record(metrics.UPLOAD_ERRORS, 1, op=op, outcome=outcome)

    def _retry(self, op: str, path: str, fn: Callable[[], T]) -> T:
        return _Attempts(self, op, path).run(fn)

    def list_dir(self, path: str) -> list[str]:
        return self._retry("list_dir", path, lambda: self.inner.list_dir(path))

    def exists(self, path: str) -> bool:
        return self._retry("exists", path, lambda: self.inner.exists(path))

    def size(self, path: str) -> int:
        return self._retry("size", path, lambda: self.inner.size(path))

    def sizes(self, paths: Sequence[str]) -> list[int]:
        """The inner storage's batch, retried as a whole (it only reads)."""
        return self._retry("sizes", paths[0] if paths else "", lambda: sizes_of(self.inner, paths))

    def mtime(self, path: str) -> float:
        return self._retry("mtime", path, lambda: self.inner.mtime(path))

    def read_bytes(self, path: str) -> bytes:
        return self._retry("read_bytes", path, lambda: self.inner.read_bytes(path))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return self._retry("read_range", path, lambda: self.inner.read_range(path, offset, length))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self._retry("read_into", path, lambda: self.inner.read_into(path, offset, buffer))

    def open_writer(self, path: str) -> Writer:
        inner = self._retry("open_writer", path, lambda: self.inner.open_writer(path))
        return _RetryingWriter(self, path, inner)

    def sync_dir(self, path: str) -> None:
        self._retry("sync_dir", path, lambda: self.inner.sync_dir(path))

    def put(self, path: str, data: bytes) -> None:
        self._retry("put", path, lambda: self.inner.put(path, data))

    def put_if_absent(self, path: str, data: bytes) -> None:
        att = _Attempts(self, "put_if_absent", path)
        while True:
            att.n += 1
            try:
                self.inner.put_if_absent(path, data)
                return
            except CommitConflictError:
                if att.n == 1:
                    raise
                # An earlier attempt failed transiently; its write may have landed anyway.
                try:
                    existing = self.inner.read_bytes(path)
                except CheckpointError:
                    existing = None
                if existing == data:
                    log.info("put_if_absent of %s: an earlier attempt landed (its reply was lost)", self.describe(path))
                    return
                raise
            except Exception as e:
                att.failed(e)

    def delete(self, path: str) -> None:
        self._retry("delete", path, lambda: self.inner.delete(path))

    def delete_dir(self, path: str) -> None:
        self._retry("delete_dir", path, lambda: self.inner.delete_dir(path))


def with_retries(storage: Storage, policy: RetryPolicy | None) -> Storage:
    """``storage`` wrapped in :class:`RetryingStorage` (unchanged if already, or if no retries)."""
    if policy is None or policy.max_attempts <= 1 or isinstance(storage, RetryingStorage):
        return storage
    return RetryingStorage(storage, policy)


__all__ = ["RetryPolicy", "RetryingStorage", "wait_log", "with_retries"]
