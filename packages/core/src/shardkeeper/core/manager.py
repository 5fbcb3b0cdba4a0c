"""``CheckpointManager``: save and restore a training state, on every rank.

Save on every rank: plan -> stage (caller's thread) -> write -> report (background) ->
commit on the coordinator (rank 0) -> retain. Restore on every rank: discover -> plan ->
ranged, verified reads -> copy in place; all ranks agree on the step and on success, and
"restore the newest" falls back to the previous committed step when a step is damaged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkeeper.core import at_exit, metrics
from shardkeeper.core.advisor import save_timings
from shardkeeper.core.assemble import assemble_manifest
from shardkeeper.core.catalog import forget_deleted, record_commit
from shardkeeper.core.codec import CodecState
from shardkeeper.core.codec.crypto import EncryptedStorage, files_look_encrypted, seal_manifest
from shardkeeper.core.codec.keys import EncryptionKeyError, key_provider
from shardkeeper.core.commit import (
    committed_steps,
    is_committed,
    load_manifest,
    manifest_path,
    manifest_steps,
    newest_committed,
    write_latest_hint,
)
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    CommitConflictError,
    CorruptCheckpointError,
    StorageError,
)
from shardkeeper.core.format.digest import DEFAULT_ALGORITHM, DEFAULT_BLOCK_BYTES, algorithms
from shardkeeper.core.format.jsonvalue import EXTENDED_MEMBER, snapshot
from shardkeeper.core.format.layout import new_attempt_id, step_dir
from shardkeeper.core.format.manifest import ROOT_BOUND_VERSION, Manifest
from shardkeeper.core.put_manifest import commit_manifest
from shardkeeper.core.quantize import check_restore_target, state_metadata
from shardkeeper.core.retention import RetentionPolicy, apply_retention
from shardkeeper.core.storage import Storage, open_storage
from shardkeeper.core.storage.retry import RetryPolicy, with_retries
from shardkeeper.core.tensor.coordination import Coordinator, make_coordinator
from shardkeeper.core.tensor.overlap import (
    STAGING_MODES,
    OptimizerTensors,
    StagingGate,
    find_optimizers,
)
from shardkeeper.core.tensor.restore import TargetWrites, restore_flat
from shardkeeper.core.tensor.restore_plan import PER_RANK_POLICIES, RestoreStats
from shardkeeper.core.tensor.save import write_shards
from shardkeeper.core.tensor.save_plan import PlanCache, SavePlan, WriteItem
from shardkeeper.core.tensor.staging import DeferredCopy, Span, Stager
from shardkeeper.core.tensor.state import flatten_for_restore, flatten_for_save

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointOptions:
    """Knobs of a manager; validated when made. Defaults suit a local disk or an object store."""

    async_save: bool = True
    """``save()`` returns once the state is staged; writing and commit run in the background."""
    staging: str = "blocking"
    """blocking: ``save()`` copies everything before it returns. overlap: the copy of the
    parameters and state of the optimizers in the saved state runs in the background, and
    their next ``optimizer.step()`` waits for it; other in-place changes of those tensors
    need ``mgr.wait_staged()`` first (docs/performance.md, "Overlapped staging")."""
    per_rank: str = "exact"
    """Per-rank state (RNG, data position) at another world size: exact | modulo | drop."""
    digest: str = DEFAULT_ALGORITHM
    """Chunk digest: xxh3_128 (fast, default) or sha256 (cryptographic)."""
    digest_block_bytes: int = DEFAULT_BLOCK_BYTES
    """Digest granularity: a ranged read is widened to these blocks to be verified."""
    commit_timeout_s: float = 1800.0
    """How long the coordinator waits for every rank's report, and ranks for the outcome."""
    io_threads: int = 4
    """Parallel file writes and ranged reads per rank."""
    max_files_per_rank: int = 4
    """A rank's chunks are spread over up to this many files, written in parallel."""
    min_file_bytes: int = 64 << 20
    """A rank writes a second file only when it has at least twice this much."""
    max_read_bytes: int = 64 << 20
    """Upper bound of one ranged read; bounds restore memory to io_threads x this."""
    catalog: str | None = None
    """``etcd://host:2379[/prefix]``: record each commit there too (a hint; the manifest is the truth)."""
    incremental: bool = False
    """Chunks equal to the previous checkpoint's are stored as references to its files."""
    compression: str | None = None
    """``"zstd"``: compress each chunk where it pays (the [zstd] extra); None: raw."""
    compression_level: int = 3
    """zstd level (1 fast ... 19 small; negative: faster still)."""
    encryption: Any = None
    """Client-side AES-256-GCM (the [crypto] extra): ``"env:VAR"``, ``"file:PATH"`` or a
    ``KeyProvider`` (docs/codecs.md, "Encryption"); None: not encrypted."""
    encryption_root: str | None = None
    """What encrypted files and manifests are bound to (a file or step of another root under
    the same key is refused); default: the root's real path or URL. To read a root that was
    moved or copied, pass the root it was written under."""
    retry_max_attempts: int = 5
    """Attempts per storage call on transient faults (throttling, resets, timeouts); 1: none."""
    retry_base_delay_s: float = 0.2
    """Backoff before retry n: uniform(0, min(retry_max_delay_s, this * 2**(n-1)))."""
    retry_max_delay_s: float = 10.0
    """Cap of one backoff."""
    retry_deadline_s: float = 120.0
    """No retry of one storage call starts later than this after its first attempt."""

    def __post_init__(self) -> None:
        if self.per_rank not in PER_RANK_POLICIES:
            raise ValueError(f"per_rank={self.per_rank!r}; choose one of {', '.join(PER_RANK_POLICIES)}")
        if self.staging not in STAGING_MODES:
            raise ValueError(f"staging={self.staging!r}; choose one of {', '.join(STAGING_MODES)}")
        if self.digest not in algorithms():
            raise ValueError(f"digest={self.digest!r}; choose one of {', '.join(algorithms())}")
        for name in ("digest_block_bytes", "io_threads", "max_files_per_rank", "min_file_bytes", "max_read_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.digest_block_bytes % 8:
            raise ValueError(f"digest_block_bytes must be a multiple of 8, got {self.digest_block_bytes}")
        if self.commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        self.retry_policy()  # validates the retry_* fields

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_attempts=self.retry_max_attempts, base_delay_s=self.retry_base_delay_s,
            max_delay_s=self.retry_max_delay_s, deadline_s=self.retry_deadline_s,
        )


@dataclass
class SaveHandle:
    """A save in flight. ``wait()`` blocks until it is committed and raises its failure."""

    step: int
    _future: Future[None]
    stall_s: float = 0.0
    deferred_bytes: int = 0
    """Bytes whose staging copy ``staging="overlap"`` deferred to the background."""
    _staged: threading.Event | None = field(default=None, repr=False)
    _delivered: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def done(self) -> bool:
        """True once the save is committed or has failed (never blocks)."""
        return self._future.done()

    def staged(self) -> bool:
        """True once the state is copied (always, unless ``staging="overlap"`` deferred it)."""
        return self._staged is None or self._staged.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the save is committed; raise its failure (on every call, not once).

        ``timeout_s``: give up waiting after that long with ``CheckpointTimeoutError`` (the
        save goes on). A Ctrl-C (``KeyboardInterrupt``) or ``SystemExit`` during the wait
        propagates at once; the save goes on in the background and is still waited for when
        the interpreter exits.
        """
        try:
            self._future.result(timeout=timeout_s)
        except BaseException as e:
            if self._is_outcome(e):  # the save's own failure
                self._deliver()
                raise
            if isinstance(e, FutureTimeout):  # the wait ran out, the save goes on
                raise CheckpointTimeoutError(f"save of step {self.step} still running after {timeout_s} s") from None
            raise  # an interrupt of the wait (Ctrl-C, SystemExit)

    def _is_outcome(self, e: BaseException) -> bool:
        """Is ``e`` the save's own failure (rather than something that interrupted a wait)?"""
        f = self._future
        return f.done() and not f.cancelled() and f.exception() is e

    def _deliver(self) -> None:
        with self._lock:
            self._delivered = True

    def _undelivered_error(self) -> BaseException | None:
        """The save's failure if it failed and nobody has seen it yet (marks it seen)."""
        f = self._future
        if not f.done() or f.cancelled():
            return None
        err = f.exception()
        with self._lock:
            first = not self._delivered
            self._delivered = True
        return err if first else None


class _DeleteOnly(RetentionPolicy):
    """A retention policy that drops exactly the given steps (for ``CheckpointManager.delete``)."""

    def __init__(self, steps: frozenset[int]) -> None:
        super().__init__()
        object.__setattr__(self, "_drop", steps)

    @property
    def keeps_all(self) -> bool:
        return False

    def retained(self, steps: Iterable[int]) -> set[int]:
        return set(steps) - self._drop  # type: ignore[attr-defined]


def _rank_world(coord: Coordinator) -> tuple[int, int]:
    return coord.rank, coord.world_size


class CheckpointManager:
    """Durable, async, resharding checkpoints under one root (a path or an fsspec URL).

    In a process group every rank creates the manager (a collective) and calls ``save()`` /
    ``restore()`` with its own local state, as with ``torch.distributed.checkpoint``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        options: CheckpointOptions | None = None,
        **option_overrides: Any,
    ) -> None:
        base = options or CheckpointOptions()
        if option_overrides:
            unknown = set(option_overrides) - set(CheckpointOptions.__dataclass_fields__)
            if unknown:
                raise TypeError(f"unknown CheckpointManager option(s): {', '.join(sorted(unknown))}")
            base = CheckpointOptions(**{**base.__dict__, **option_overrides})
        self.options = base
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        self.storage: Storage = with_retries(open_storage(root, **dict(storage_options or {})), base.retry_policy())
        self._keys = key_provider(base.encryption)
        self._read_storage = self.storage  # manifests read through it are authenticated
        if self._keys is not None:
            encrypted = EncryptedStorage(self.storage, self._keys, root=base.encryption_root)
            self._binding = encrypted.binding  # what its manifests are sealed to
            self.storage = encrypted
            self._read_storage = self.storage.authenticated()
        self.metadata, _ = snapshot(dict(metadata or {}), "metadata key")
        self._coord = make_coordinator(process_group)
        self.rank, self.world_size = _rank_world(self._coord)
        self._io = ThreadPoolExecutor(base.io_threads, thread_name_prefix="shardkeeper-io")
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="shardkeeper-save")
        self._stager = Stager()
        self._plans = PlanCache()
        self._gate = StagingGate()
        self._codecs = CodecState(
            incremental=base.incremental, compression=base.compression, level=base.compression_level,
            encrypted=self._keys is not None,
        )
        self._pending: SaveHandle | None = None
        self._seq = 0
        self._closed = False
        self.last_restore_stats: RestoreStats | None = None
        at_exit.track(self)

    # -- save --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        async_save: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Stage ``state`` and return; write and commit in the background (see ``async_save``).

        A save started while the previous one still writes first waits for it (that wait
        counts as stall), and raises the previous save's failure if nobody has seen it yet.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        self._wait_pending(raise_error=True)
        refused = self._refuse_committed(step)
        if refused is not None:
            self._report_refusal(step, refused)
            raise refused
        flat = flatten_for_save(state, self.rank)
        plan, groups = self._plans.plan(flat, self.rank, self.world_size, self.options.max_files_per_rank,
                                        self.options.min_file_bytes)
        synchronous = not (self.options.async_save if async_save is None else async_save)
        self._sync_save = synchronous  # read by this save's _run_save (timings for the advisor)
        # A synchronous save returns after the commit, so the caller cannot change its tensors
        # meanwhile: they are written from their own memory, without a staging copy.
        defer = None
        if self.options.staging == "overlap" and not synchronous:
            optimizers = find_optimizers(state)
            self._gate.install(optimizers)
            owned = OptimizerTensors(optimizers)
            if owned:
                defer = owned.owners
        spans, deferred = self._stager.stage_split(groups, copy=not synchronous, defer=defer, token=plan.token,
                                                   sources=plan.sources)
        objects, extended = snapshot(plan.objects, "state key")  # by value, checked to come back exactly
        meta, _ = snapshot({**self.metadata, **state_metadata(state), **dict(metadata or {})}, "metadata key")
        seq, self._seq = self._seq, self._seq + 1
        attempt = new_attempt_id()
        # The writer starts once save() is done with its own work: writer threads compete
        # for the GIL, and the caller's last steps should not wait on them.
        released = threading.Event()
        staged = self._gate.begin(deferred) if deferred is not None else None
        try:
            future = self._bg.submit(
                self._run_save, step, seq, attempt, plan, groups, spans, objects, extended, meta, released, deferred,
                staged,
            )
        except BaseException:
            if staged is not None:
                staged.set()  # nothing will copy: never leave an optimizer step waiting
            raise
        try:
            handle = SaveHandle(step, future, _staged=staged)
            handle.deferred_bytes = deferred.nbytes if deferred is not None else 0
            self._pending = handle
            handle.stall_s = time.perf_counter() - t0
            metrics.record(metrics.STALL_SECONDS, handle.stall_s, rank=self.rank, step=step)
            log.info(
                "rank %d step %d: staged %d chunks, %d bytes in %.3f s (stall)",
                self.rank, step, len(plan.items), plan.nbytes, handle.stall_s,
            )
        finally:
            released.set()
        if synchronous:
            handle.wait()
        return handle

    def _refuse_committed(self, step: int) -> CommitConflictError | None:
        """One stat of the step's manifest: a step that is already committed (an off-by-one
        after a resume, a fresh run on a used root) is refused before anything is written.
        The fenced commit stays the real guarantee against a writer racing this one."""
        path = manifest_path(step)
        try:
            if not self.storage.exists(path):
                return None
        except CheckpointError:
            return None  # the commit decides; a failing storage fails the save there
        newest = self.latest_step()
        return CommitConflictError(
            f"step {step} is already committed under {self.storage.url} ({self.storage.describe(path)} "
            f"exists; rank {self.rank}); this save wrote nothing. The newest committed step is "
            f"{newest}: after a resume, save the steps after the restored one (restore() returns "
            f"it); to replace step {step}, delete it first (mgr.delete({step})), or save under "
            f"another root"
        )

    def _report_refusal(self, step: int, err: CheckpointError) -> None:
        """A save refused on this rank still takes its turn in the commit protocol: the
        coordinator hears a failure report (or publishes one), so no other rank waits for
        this rank's report until the timeout."""
        seq, self._seq = self._seq, self._seq + 1
        future = self._bg.submit(self._run_refused, step, seq, err)
        handle = SaveHandle(step, future)
        handle._deliver()  # raised to the caller right now
        self._pending = handle

    def _run_refused(self, step: int, seq: int, err: CheckpointError) -> None:
        if self.world_size == 1:
            raise err
        payload = {"ok": False, "rank": self.rank, "phase": "check", "path": self.storage.describe(step_dir(step)),
                   "error": f"{type(err).__name__}: {err}"}
        if self.rank == 0:
            self._coord.publish(seq, payload)
        else:
            self._coord.report(seq, payload)
            self._coord.outcome(seq, 2 * self.options.commit_timeout_s + 30.0, step=step)
        raise err

    def _run_save(
        self,
        step: int,
        seq: int,
        attempt: str,
        plan: SavePlan,
        groups: list[list[WriteItem]],
        spans: list[list[Span]],
        objects: dict[str, Any],
        extended: bool,
        meta: dict[str, Any],
        released: threading.Event,
        deferred: DeferredCopy | None = None,
        staged: threading.Event | None = None,
    ) -> None:
        released.wait()
        sdir = step_dir(step)
        t0 = time.perf_counter()
        phase = "write"
        try:
            if deferred is not None and staged is not None:
                phase = "stage"
                self._gate.run(deferred, staged)
                phase = "write"
            codecs = self._codecs.for_save(self._read_storage, step, self.options.digest, self.options.digest_block_bytes)
            res = write_shards(
                self.storage, sdir, groups, spans, rank=self.rank, attempt=attempt,
                algorithm=self.options.digest, block_bytes=self.options.digest_block_bytes,
                executor=self._io, codecs=codecs, memo=plan.memo,
            )
            payload: dict[str, Any] = {
                "ok": True,
                "rank": self.rank,
                "attempt": attempt,
                **plan.report_declarations(coordinator=self.rank == 0),
                "chunks": res.chunks,
                "files": res.files,
                "objects": objects,
                # the committed step whose manifest this save's references come from
                "bases": [codecs.reuse.base.step] if codecs.reuse is not None and codecs.reuse.usable else [],
                EXTENDED_MEMBER: extended,  # the coordinator then parses the report exactly
                "per_rank_prefixes": plan.per_rank_prefixes,
                "layouts": sorted(plan.layouts),
                # for the interval advisor (manifest metadata "timings"); _pending is this save
                "timings": {"stall_s": self._pending.stall_s if self._pending is not None else 0.0,
                            "write_s": time.perf_counter() - t0, "sync": getattr(self, "_sync_save", False)},
            }
            log.info("rank %d step %d: wrote %d bytes in %.3f s", self.rank, step, res.bytes_written, time.perf_counter() - t0)
            metrics.record(metrics.BYTES_WRITTEN, res.bytes_written, rank=self.rank, step=step)
        except BaseException as e:
            payload = {
                "ok": False, "rank": self.rank, "phase": phase, "path": self.storage.describe(sdir),
                "error": f"{type(e).__name__}: {e}",
            }
            local_error: BaseException | None = e
        else:
            local_error = None
        timeout = self.options.commit_timeout_s
        if self.rank == 0:
            outcome = self._commit(step, seq, attempt, meta, timeout, payload)
            self._coord.publish(seq, outcome)
        else:
            self._coord.report(seq, payload)
            # The coordinator always publishes an outcome, at the latest when its own wait
            # for reports times out: wait for it longer than that.
            outcome = self._coord.outcome(seq, 2 * timeout + 30.0, step=step)
        if local_error is not None:
            raise CheckpointSaveError(
                f"save of step {step} failed on rank {self.rank} in phase {phase} at "
                f"{self.storage.describe(sdir)}: {type(local_error).__name__}: {local_error}; "
                f"the checkpoint was not committed",
                step=step, failures={self.rank: payload},
            ) from local_error
        if not outcome.get("ok"):
            fr = outcome.get("rank")
            if outcome.get("conflict"):
                raise CommitConflictError(
                    f"step {step} was committed under {self.storage.url} by another writer while "
                    f"this save ran (two jobs on one root: a restarted job racing a zombie); this "
                    f"save's files were discarded. Stop the other writer, or save under another root"
                )
            raise CheckpointSaveError(
                f"save of step {step} failed on rank {fr} in phase {outcome.get('phase')} at "
                f"{outcome.get('path')}: {outcome.get('error')}; the checkpoint was not committed",
                step=step, failures={fr if isinstance(fr, int) else -1: outcome},
            )
        metrics.record(metrics.LAST_COMMITTED_STEP, step, rank=self.rank, step=step)
        metrics.record(metrics.SAVE_SECONDS, time.perf_counter() - t0, rank=self.rank, step=step)
        if self.rank == 0:
            self._retain(step)

    def _commit(
        self, step: int, seq: int, attempt: str, meta: dict[str, Any], timeout: float, own: dict[str, Any]
    ) -> dict[str, Any]:
        """Coordinator: collect reports, check tiling, write the manifest if absent."""
        sdir = step_dir(step)
        reports: list[dict[str, Any]] = []
        t_commit = time.perf_counter()
        try:
            reports = self._coord.collect(seq, own, timeout, step=step)
            for r in reports:
                if not r.get("ok"):
                    return r
            manifest = assemble_manifest(
                step, attempt, reports, world_size=self.world_size, digest=self.options.digest,
                block_bytes=self.options.digest_block_bytes,
                metadata={"framework": "torch", "torch_version": str(torch.__version__), **meta,
                          "timings": save_timings(reports, time.perf_counter() - t_commit)},
            )
            if self._keys is not None:  # bound to its root: readers before version 6 would refuse its files
                manifest.format_version = max(manifest.format_version, ROOT_BOUND_VERSION)
            data = manifest.dumps()
            data = data if self._keys is None else seal_manifest(data, self._keys, self._binding)
            bases = sorted({b for r in reports for b in r.get("bases", ())})
            commit_manifest(self.storage, step, manifest, data, bases=bases)
        except BaseException as e:
            self._discard_attempt(sdir, reports)
            return {
                "ok": False, "rank": 0, "phase": "commit", "path": self.storage.describe(sdir),
                "error": f"{type(e).__name__}: {e}", "conflict": isinstance(e, CommitConflictError),
            }
        try:
            write_latest_hint(self.storage, step)
        except CheckpointError as e:  # a hint only; the manifest is the truth
            log.warning("step %d committed, but the LATEST hint was not updated: %s", step, e)
        record_commit(self.options.catalog, self.storage, step, manifest)
        log.info("step %d committed at %s (%d leaves)", step, self.storage.describe(sdir), len(manifest.leaves))
        return {"ok": True, "rank": 0}

    def _discard_attempt(self, sdir: str, reports: Sequence[dict[str, Any]]) -> None:
        for r in reports:
            for rel in r.get("files", {}):
                try:
                    self.storage.delete(f"{sdir}/{rel}")
                except CheckpointError:
                    pass

    def _retain(self, step: int) -> None:
        if self.retention.keep_last is None and self.retention.keep_every is None:
            return
        try:
            deleted = apply_retention(self.storage, self.retention, protect=[step])
        except Exception as e:  # retention must never fail a committed save
            log.warning("retention after step %d failed (will retry after the next save): %s", step, e)
        else:
            forget_deleted(self.options.catalog, self.storage, deleted)

    def _wait_pending(self, *, raise_error: bool) -> None:
        """Wait for the pending save. A Ctrl-C during the wait propagates at once (the save
        goes on; the handle stays pending, so the next call and the exit still wait for it)."""
        p = self._pending
        if p is None:
            return
        futures_wait([p._future])
        if not raise_error:  # keep the handle: its failure reaches the next save() or wait()
            return
        self._pending = None
        err = p._undelivered_error()
        if err is not None:
            raise err

    def _finish_at_exit(self) -> str | None:
        """At interpreter exit (``at_exit``): wait for the pending save; describe its failure
        if nobody has seen it."""
        p = self._pending
        if p is None or self._closed:
            return None
        futures_wait([p._future])
        err = p._undelivered_error()
        if err is None:
            return None
        return (f"the save of step {p.step} under {self.storage.url} (rank {self.rank}) failed at exit "
                f"and was not committed: {type(err).__name__}: {err}")

    # -- restore -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (reads and validates every manifest of the root: to ask
        about one step or the newest, ``is_committed`` and ``latest_step`` read one)."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None; manifests are validated newest first only until
        one validates."""
        return newest_committed(self.storage)

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed under the root (its manifest exists and validates)."""
        return is_committed(self.storage, step)

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (None: the newest committed): its leaves (keys,
        kinds, shapes, dtypes), world size and metadata, without reading any tensor data."""
        self._check_open()
        if step is None:
            step = newest_committed(self.storage)
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.storage.url} (rank {self.rank})"
                )
        return load_manifest(self._read_storage, step)  # authenticated when encrypted

    def step_url(self, step: int) -> str:
        """Where ``step``'s directory lives (a path or URL), for messages and other tools."""
        return self.storage.describe(step_dir(step))

    def delete(self, step: int) -> bool:
        """Delete committed ``step`` with retention's guarantees; True if it is gone.

        Call it on every rank (a collective); the coordinator deletes. This manager's pending
        save is waited for first (its failure stays for the next ``wait()``), so it never races
        the deletion; a commit of another process that references ``step`` keeps the files it
        needs (``pending.py``). Never deletes the newest committed step, nor files that another
        retained step references (returns False for the newest: ask again later). A step that
        is not committed counts as gone.
        """
        self._check_open()
        self._wait_pending(raise_error=False)
        code, err = 0, None
        if self.rank == 0:
            try:
                deleted = apply_retention(self.storage, _DeleteOnly(frozenset([step])))
                forget_deleted(self.options.catalog, self.storage, deleted)
                code = int(step not in committed_steps(self.storage))
            except Exception as e:
                code, err = -1, e
        if self.world_size > 1:
            code = self._coord.agree_int(code, "bcast")
        if code < 0:
            raise err or CheckpointError(
                f"deleting step {step} under {self.storage.url} failed on the coordinator (rank 0); "
                f"see its error (rank {self.rank})"
            )
        return code == 1

    def restore(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        only: str | Sequence[str] | None = None,
        *,
        strict: bool = True,
        per_rank: str | None = None,
        cast_dtypes: bool = False,
        optional: str | Sequence[str] | None = None,
    ) -> int:
        """Restore ``state`` in place from ``step`` (None: the newest committed); return the step.

        ``only`` takes key patterns (``"model/*"``) for a partial restore; ``optional`` takes
        patterns of target keys that may be absent from the checkpoint (``"rng/*"`` when
        restoring a checkpoint another framework wrote): those keep their values, silently.
        A stateful object gets ``load_state_dict`` only when some of its keys were restored,
        and only after every read succeeded.
        When the newest step turns out damaged, the previous committed one is restored
        instead, with a warning: it rewrites every key the damaged step's attempt wrote, or
        the restore fails naming the keys it cannot rewrite. When the storage fails (after its
        retries), the error is raised, since the step may be intact. An error raised after
        reads wrote into ``state`` says that it is partly restored.
        """
        self._check_open()
        policy = per_rank or self.options.per_rank
        if policy not in PER_RANK_POLICIES:
            raise ValueError(f"per_rank={policy!r}; choose one of {', '.join(PER_RANK_POLICIES)}")
        patterns = [only] if isinstance(only, str) else (list(only) if only else None)
        optional_patterns = [optional] if isinstance(optional, str) else list(optional or [])
        self._wait_pending(raise_error=False)
        explicit = step is not None
        # Newest first by listing alone: each candidate's manifest is validated when it is
        # loaded, and a damaged one falls back to the next (never a parse of every manifest).
        candidates = [step] if step is not None else sorted(manifest_steps(self.storage), reverse=True)
        if self.world_size > 1:
            candidates = self._agree_candidates(candidates)
        if not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.storage.url}; nothing to restore (rank "
                f"{self.rank}). Check the root, or start training from scratch"
            )
        last_error: BaseException | None = None
        damaged: list[int] = []
        writes = TargetWrites()  # what the attempts wrote into ``state``: a fallback rewrites it all
        for s in candidates:
            code, err = self._restore_step(state, s, patterns, strict, policy, cast_dtypes, optional_patterns, writes)
            if self.world_size > 1:
                code = self._coord.agree_int(code, "max")
            if code == 0:
                if last_error is not None:
                    log.warning(
                        "rank %d restored step %d under %s instead of the newer, damaged step(s) %s "
                        "(last error: %s); run `shardkeeper verify %s` to see the damage",
                        self.rank, s, self.storage.url, ", ".join(map(str, damaged)), last_error,
                        self.storage.url,
                    )
                return s
            if err is None:
                err = CheckpointRestoreError(
                    f"restore of step {s} failed on another rank (rank {self.rank} succeeded); "
                    f"see that rank's error"
                )
            if code == 2 or explicit:
                raise self._partly_restored(err, writes)
            last_error = err
            damaged.append(s)
            warnings.warn(
                f"step {s} under {self.storage.url} is damaged ({err}); falling back to the "
                f"previous committed step",
                stacklevel=2,
            )
        assert last_error is not None
        raise self._partly_restored(CheckpointRestoreError(
            f"no committed step under {self.storage.url} could be restored (rank {self.rank}); the last "
            f"error: {last_error}"
        ), writes) from last_error

    def _agree_candidates(self, candidates: list[int]) -> list[int]:
        """Every rank uses rank 0's list of steps (its listing may be fresher)."""
        n = self._coord.agree_int(len(candidates), "bcast")
        out = []
        for i in range(n):
            out.append(self._coord.agree_int(candidates[i] if i < len(candidates) else -1, "bcast"))
        return out

    @staticmethod
    def _partly_restored(err: BaseException, writes: TargetWrites) -> BaseException:
        """``err``, its message extended by a warning when failed restore attempts wrote into the
        target (its type and attributes kept: callers catch e.g. ``ChecksumMismatchError``)."""
        if not writes.keys:
            return err
        keys = sorted(writes.keys)
        shown = ", ".join(repr(k) for k in keys[:4]) + (" ..." if len(keys) > 4 else "")
        note = (
            f"The target state is partly restored: reads of step(s) {', '.join(map(str, writes.steps))} "
            f"wrote {len(keys)} of its keys ({shown}) before the restore failed; do not train from it; "
            f"restore again or rebuild it"
        )
        if err.args and isinstance(err.args[0], str) and type(err).__str__ is BaseException.__str__:
            err.args = (f"{err.args[0].rstrip('. ')}. {note}", *err.args[1:])
        elif hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note(note)
        else:
            wrapped = CheckpointRestoreError(f"{type(err).__name__}: {err}. {note}")
            wrapped.__cause__ = err
            return wrapped
        return err

    def _restore_step(
        self, state: Mapping[str, Any], step: int, patterns: list[str] | None, strict: bool, policy: str,
        cast: bool, optional: list[str], writes: TargetWrites,
    ) -> tuple[int, BaseException | None]:
        """0 = restored, 1 = this step is damaged (fall back), 2 = an error no step fixes."""
        t0 = time.perf_counter()
        try:
            manifest = load_manifest(self._read_storage, step)
            if self._keys is None and manifest.encryption is not None:
                if not files_look_encrypted(self.storage, step, manifest):
                    raise CorruptCheckpointError(
                        f"step {step} under {self.storage.url}: its manifest says it is encrypted, but its data "
                        f"files are not: the manifest was edited or damaged; restore another step"
                    )
                raise EncryptionKeyError(
                    f"step {step} under {self.storage.url} is encrypted (key {manifest.encryption.get('key_id')}); "
                    f"pass its key: CheckpointManager(..., encryption='env:VAR' | 'file:PATH' | a KeyProvider)"
                )
            check_restore_target(manifest.metadata, state, f"step {step} under {self.storage.url}")
            flat = flatten_for_restore(state, self.rank, strict=strict)
            self.last_restore_stats = restore_flat(
                self.storage, step_dir(step), manifest, flat, rank=self.rank,
                world_size=self.world_size, only=patterns, strict=strict, optional=optional, per_rank=policy,
                cast=cast, executor=self._io, max_read_bytes=self.options.max_read_bytes, writes=writes,
            )
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:  # damaged, or gone since listed
            return 1, e
        except StorageError as e:
            # The storage failed (its retries are spent); the step may be intact. Falling back
            # would resume from older state and lose the newer step's progress: fail loudly.
            err = StorageError(
                f"restore of step {step} under {self.storage.url} (rank {self.rank}) failed because "
                f"the storage did: {e}; the checkpoint may be intact: retry the restore, or pass "
                f"step= to restore an earlier step"
            )
            err.__cause__ = e
            return 2, err
        except Exception as e:
            return 2, e
        st = self.last_restore_stats
        metrics.record(metrics.RESTORE_SECONDS, time.perf_counter() - t0, rank=self.rank, step=step)
        metrics.record(metrics.BYTES_READ, st.bytes_read, rank=self.rank, step=step)
        log.info(
            "rank %d restored step %d: %d keys, read %d bytes (%d needed) in %.3f s",
            self.rank, step, st.keys, st.bytes_read, st.bytes_needed, time.perf_counter() - t0,
        )
        return 0, None

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_staged(self) -> None:
        """Block until the pending save has copied the state (``staging="overlap"``).

        Call it before changing saved tensors in place outside ``optimizer.step()`` (EMA
        updates, manual edits, ``load_state_dict``). Cheap when nothing is being staged.
        """
        self._gate.wait()

    @property
    def staging_waits(self) -> int:
        """How many times an optimizer step or ``wait_staged()`` waited for overlapped staging."""
        return self._gate.waits

    def wait(self) -> None:
        """Block until the pending save is committed; raise its failure if not yet seen."""
        self._wait_pending(raise_error=True)

    def close(self) -> None:
        """Wait for the pending save (raising its failure if not yet seen), then release the
        threads. Idempotent. A Ctrl-C during the wait propagates at once and leaves the manager
        open: the save goes on and is still waited for at exit."""
        if self._closed:
            return
        try:
            self.wait()
        except Exception:
            self._shutdown()
            raise
        self._shutdown()

    def _shutdown(self) -> None:
        self._gate.close()
        self._closed = True
        at_exit.untrack(self)
        self._bg.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self.storage.url} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            return  # Ctrl-C / SystemExit: propagate at once; the exit still waits for the save
        self.close()

    def __del__(self) -> None:
        p = getattr(self, "_pending", None)
        if p is not None and not getattr(self, "_closed", True):
            warnings.warn(
                f"CheckpointManager for {self.storage.url} was garbage-collected with a save of "
                f"step {p.step} never waited for; call mgr.wait() or mgr.close()",
                ResourceWarning,
                stacklevel=1,
            )
