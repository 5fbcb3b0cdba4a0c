"""The persistent tier: every ``persist_every`` steps, a locally committed step is uploaded
from the local files (not from the staging buffer, which the next save reuses) to the
persistent root, in the background, and committed there with the fenced protocol.

Each rank uploads the files it wrote, after checking them against the manifest's digests (a
local copy damaged since it was written is never uploaded: the persistent root is the tier of
last resort, and its commit checks only that files are there at their sizes); the
coordinator waits until every rank has (through the
c10d store), checks that the step's claim is this writer's (``commit/claim.py``), commits the
manifest with ``put_manifest.commit_manifest`` (its intent, its checks that every file is there
at its size, put-if-absent), applies the manager's retention to the persistent root, removes
the claims up to the step, and publishes the outcome. One upload runs at a time: the next one waits for
the previous one (every rank alike, so the ranks stay in step), and local retention never
deletes a step whose upload is running. A failed upload is logged at once and raised by
``wait_persisted()`` or ``close()``; the step stays committed in the local tier.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shardkeeper.core.commit.claim import Claims
from shardkeeper.core.commit.committed import write_latest_hint
from shardkeeper.core.commit.put import commit_manifest
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointSaveError,
    CommitConflictError,
    CorruptCheckpointError,
    StepClaimedError,
)
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.runtime.store_channel import CoordinatorLostError, StoreTimeout
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify.step import verify_step

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

COORDINATOR = 0
_COPY_BYTES = 64 << 20


def copy_file(src: Storage, dst: Storage, path: str) -> None:
    """``path`` from ``src`` to ``dst`` as it is (encrypted bytes stay encrypted), in pieces."""
    size = src.size(path)
    writer = dst.open_writer(path)
    try:
        buf = np.empty(min(_COPY_BYTES, max(size, 1)), dtype=np.uint8)
        pos = 0
        while pos < size:
            n = min(len(buf), size - pos)
            src.read_into(path, pos, memoryview(cast("Buffer", buf))[:n])
            writer.write(bytes(memoryview(cast("Buffer", buf))[:n]))  # the writer may keep it until close (retries)
            pos += n
    except BaseException:
        writer.abort()
        raise
    writer.close()


class Persister:
    """Uploads of one manager. ``storage``: the persistent root as the save writes it
    (encrypting when keyed; manifests go through it), ``raw``: the same without encryption,
    ``local``: this node's directory without encryption, ``local_read``: the same as restores
    read it (decrypting, authenticated), through which the files are checked."""

    def __init__(
        self,
        coord: Any,
        every: int | None,
        *,
        local: Storage,
        local_read: Storage,
        storage: Storage,
        raw: Storage,
        retention: RetentionPolicy,
        catalog: str | None,
        io: Any,
        timeout_s: float,
        newest: int | None,
        claims: Claims,
    ) -> None:
        self.coord, self.every, self.claims = coord, every, claims
        # Its own connection: its long waits (the ranks' uploads, the outcome) never hold up
        # the next save's reports, which go through the coordinator's.
        self.store = coord.channel("an upload to the persistent tier")
        self.local, self.local_read, self.storage, self.raw = local, local_read, storage, raw
        self.retention, self.catalog, self.io, self.timeout_s = retention, catalog, io, timeout_s
        self.last_step = newest  # the newest step persisted or being persisted
        self.persisted: list[int] = []  # steps this manager committed to the persistent root
        self.in_flight: set[int] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-persist")
        self._last: Future[None] | None = None
        self._previous: int | None = newest
        self._error: BaseException | None = None
        #: the newest step committed locally, as ``submit`` takes it (without its references)
        self.kept: tuple[int, dict[str, int], Manifest | None, bytes | None] | None = None

    def due(self, step: int) -> bool:
        """Coordinator, committing ``step``: whether it is uploaded (the ranks hear the answer
        with the commit, ``record.py``, so they never disagree)."""
        return self.every is not None and (self.last_step is None or step >= self.last_step + self.every)

    def forget_above(self, newest: int | None) -> None:
        """Every rank alike, after a restore quarantined the persistent root's steps above
        ``newest`` (its newest step left; None: none left): ``due`` counts from ``newest``, so
        that a save of one of those steps is uploaded again when due."""
        if self.last_step is not None and (newest is None or self.last_step > newest):
            self.last_step = self._previous = newest

    def keep(self, step: int, files: dict[str, int], manifest: Manifest | None, data: bytes | None) -> None:
        """Every rank, ``step`` committed locally: what a preemption uploads (``Tiering.flush``)."""
        self.kept = (step, files, manifest, data)

    def submit(
        self,
        step: int,
        files: dict[str, int],
        manifest: Manifest | None,
        data: bytes | None,
        refs: Sequence[str] = (),
    ) -> None:
        """Upload ``files`` (root-relative path -> size: the ones this rank wrote) of ``step``,
        and those of ``refs`` (files of earlier steps an incremental save points at, this
        rank's share) that the persistent root lacks; the coordinator also commits ``manifest``
        (whose exact bytes are ``data``)."""
        if self._last is not None:
            futures_wait([self._last])  # one upload at a time, every rank alike
        self._previous, self.last_step = self.last_step, step
        with self._lock:
            self.in_flight.add(step)
        self._last = self._pool.submit(self._run, step, files, manifest, data, list(refs))

    def _key(self, step: int, name: str) -> str:
        return f"{self.coord.namespace}/persist/{step}/{name}"

    def _run(
        self, step: int, files: dict[str, int], manifest: Manifest | None, data: bytes | None, refs: list[str]
    ) -> None:
        store, me, world = self.store, self.coord.rank, self.coord.world_size
        try:
            try:
                missing = [p for p in sorted(refs) if not self.raw.exists(p)]  # uploaded with their own step, or now
                self._check(step, [*sorted(files), *missing])
                for path in [*sorted(files), *missing]:
                    copy_file(self.local, self.raw, path)
            except BaseException as e:
                store.set(self._key(step, f"failed/{me}"), f"{type(e).__name__}: {e}")
                store.add(self._key(step, "failures"), 1)
            if store.add(self._key(step, "count"), 1) == world:
                store.set(self._key(step, "wake"), b"1")
            if me == COORDINATOR:
                outcome = self._commit(store, step, manifest, data)
                store.set(self._key(step, "outcome"), json.dumps(outcome))
            store.wait([self._key(step, "outcome")], timedelta(seconds=2 * self.timeout_s + 30))
            outcome = json.loads(store.get(self._key(step, "outcome")))
            if store.add(self._key(step, "acks"), 1) == world:
                for name in ("count", "wake", "failures", "outcome", "acks"):
                    store.delete_key(self._key(step, name))
            if isinstance(outcome, dict):  # another writer's claim or manifest: raised as what it is
                self.last_step = self._previous
                raise (StepClaimedError if outcome["claimed"] else CommitConflictError)(
                    f"{outcome['conflict']} (rank {me})"
                )
            if outcome is not None:
                self.last_step = self._previous  # every rank heard the same outcome: the next save is due
                raise CheckpointSaveError(
                    f"step {step} was not uploaded to {self.storage.url} ({outcome}); it is committed in the "
                    f"local tier only (kept there as local_keep allows), and the next save is uploaded instead "
                    f"(rank {me})",
                    step=step,
                )
            self.persisted.append(step)
            log.info("step %d persisted to %s", step, self.storage.url)
        except BaseException as e:
            if isinstance(e, CoordinatorLostError):  # named with its step, torch's error chained
                lost = CheckpointSaveError(
                    f"the upload of step {step} to {self.storage.url} (rank {me}): {e}; the step stays committed in "
                    f"the local tier",
                    step=step,
                )
                lost.__cause__ = e
                e = lost
            log.warning("rank %d: %s", me, e)
            self._error = e
        finally:
            with self._lock:
                self.in_flight.discard(step)

    def _check(self, step: int, paths: list[str]) -> None:
        """Raise ``CorruptCheckpointError`` when this node's copy of one of ``paths`` (files
        of ``step`` or files it points at) fails the manifest's digests or sizes."""
        if not paths:
            return
        report = verify_step(self.local_read, step, files=paths)
        if not report.ok:
            first = report.problems[0]
            raise CorruptCheckpointError(
                f"this node's copy of step {step} in {self.local.url} is damaged ({len(report.problems)} problem(s); "
                f"{first.message}); it is not uploaded, so the persistent root never holds the damage. A restore "
                f"replaces a damaged copy it reads with another node's good one; `shardkeeper verify "
                f"{self.local.url} {step}` on this node shows the damage"
            )

    def _commit(
        self, store: Any, step: int, manifest: Manifest | None, data: bytes | None
    ) -> str | dict[str, Any] | None:
        """Coordinator: wait for every rank's upload, check the claim, then commit; the
        failure (``{"conflict": message, "claimed": bool}`` for another writer's claim or
        manifest of the step), or None."""
        assert manifest is not None and data is not None
        try:
            store.wait([self._key(step, "wake")], timedelta(seconds=self.timeout_s))
        except StoreTimeout as e:
            return f"not every rank uploaded its files within {self.timeout_s:.0f} s ({e})"
        failed = int(store.add(self._key(step, "failures"), 0))
        if failed:
            why = [
                f"rank {r}: {store.get(self._key(step, f'failed/{r}')).decode(errors='replace')}"
                for r in range(self.coord.world_size)
                if store.check([self._key(step, f"failed/{r}")])
            ]
            return "; ".join(why)
        try:
            claimed = self.claims.check(step)
            if claimed is not None:
                return {"conflict": str(claimed), "claimed": True}
            commit_manifest(self.storage, step, manifest, data, bases=[], executor=self.io)
        except CommitConflictError as e:
            return {
                "conflict": f"step {step} was not uploaded to {self.storage.url}: another writer committed it there "
                f"({e}); it stays committed in the local tier only. Two jobs are writing this root: stop the other "
                f"one, or save under another root",
                "claimed": False,
            }
        except CheckpointError as e:
            return f"{type(e).__name__}: {e}"
        try:
            write_latest_hint(self.storage, step)
        except CheckpointError as e:  # a hint only
            log.warning("step %d persisted, but the LATEST hint was not updated: %s", step, e)
        deletion.retain(self.storage, self.retention, self.catalog, step)
        self.claims.sweep(step)
        return None

    def abandon(self, why: str) -> None:
        """Coordinator, its persist process ending with another rank's gone (``why``): the
        running upload stops waiting for the other ranks' parts and fails (its step stays
        committed in the local tier)."""
        with self._lock:
            steps = sorted(self.in_flight)
        store = self.coord.channel("abandoning an upload") if steps else None
        for step in steps:
            assert store is not None
            store.set(self._key(step, f"failed/{self.coord.rank}"), why)
            store.add(self._key(step, "failures"), 1)
            store.set(self._key(step, "wake"), b"1")

    def await_acks(self, wait_s: float) -> None:
        """Rank 0, about to exit (its store goes with it): wait up to ``wait_s`` until every
        rank has read the outcome of the last upload (its keys go once the last rank read it)."""
        if self.last_step is None:
            return
        key = self._key(self.last_step, "outcome")
        deadline = time.monotonic() + wait_s
        try:
            while self.store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is ours; nothing else to wait for
            return

    def protected(self) -> Sequence[int]:
        with self._lock:
            return sorted(self.in_flight)

    def join(self) -> None:
        """Wait for the running upload, keeping its failure for ``wait``."""
        if self._last is not None:
            futures_wait([self._last])

    def wait_for(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the running upload; whether none runs now."""
        if self._last is None:
            return True
        futures_wait([self._last], timeout=max(0.0, timeout_s))
        return self._last.done()

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the running upload; raise an upload failure nobody has seen."""
        if self._last is not None:
            futures_wait([self._last])
        err, self._error = self._error, None
        if err is not None and raise_error:
            raise err

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["Persister", "copy_file"]
