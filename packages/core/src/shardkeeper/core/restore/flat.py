"""Restore, per rank: plan (``restore/plan.py``), check before reading, fill
(``restore/fill.py``), then set objects and run finalizers.

Bytes that fail verification never stay in the target, and what an attempt wrote into it is
recorded (:class:`TargetWrites`), so that a fallback to another step rewrites all of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import posixpath
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkeeper.core.codec.read import ChunkReader, size_or_none
from shardkeeper.core.errors import CheckpointRestoreError, CorruptCheckpointError
from shardkeeper.core.format.bounds import stored_bytes_problem
from shardkeeper.core.format.columns import without_gc
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import LeafRecord
from shardkeeper.core.restore.fill import (
    execute_direct,
    execute_encoded,
    execute_read,
    read_bytes_leaf,
)
from shardkeeper.core.restore.finalize import set_and_finalize
from shardkeeper.core.restore.logical_check import LogicalCheck, plan_check
from shardkeeper.core.restore.per_rank import PLAIN_CALL, warn_world_change
from shardkeeper.core.restore.plan import (
    Op,
    RestorePlan,
    RestoreStats,
    listing,
    missing_list,
    plan_restore,
)
from shardkeeper.core.restore.reads import Read, schedule
from shardkeeper.core.restore.share import Job, ReadShare
from shardkeeper.core.restore.sum_as_filled import SumsAsFilled
from shardkeeper.core.state.flatten import FlatState
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass
class TargetWrites:
    """What the attempts of one ``restore()`` wrote into its target: the target keys whose
    values an attempt may have changed (in place, or by replacing an object), and the steps
    those attempts read. A later attempt must rewrite every one of these keys
    (``restore_flat`` refuses before reading otherwise), so no value of a failed step survives
    a fallback."""

    keys: set[str] = field(default_factory=set)
    steps: list[int] = field(default_factory=list)

    def add(self, step: int, keys: Collection[str]) -> None:
        if keys:
            self.keys.update(keys)
            if step not in self.steps:
                self.steps.append(step)


def _join(step_dir: str, file: str) -> str:
    """A chunk's file as a root-relative path: a reference (``../step-N/data/...``) is
    normalized here, because object stores do not resolve ``..`` in keys. An empty
    ``step_dir`` is the root itself (a source folder opened as the storage: hf/load.py)."""
    path = f"{step_dir}/{file}" if step_dir else file
    return posixpath.normpath(path) if file.startswith("../") else path


def _guarded(fn: Callable[..., None], failed: threading.Event) -> Callable[..., None]:
    """``fn`` (a read into the target) under no_grad (it is per thread: the copies into leaf
    tensors that require grad run in the pool); it does nothing once another read of the
    same attempt failed, and a failure of its own sets ``failed``."""

    def run(*args: Any) -> None:
        if failed.is_set():
            return  # the attempt has failed: write nothing more into the target
        try:
            with torch.no_grad():
                fn(*args)
        except BaseException:
            failed.set()
            raise

    return run


@without_gc  # planning makes a few objects per chunk: no full collections meanwhile
def restore_flat(
    storage: Storage,
    step_dir: str,
    manifest: Manifest,
    flat: FlatState,
    *,
    rank: int,
    world_size: int,
    only: Sequence[str] | None,
    strict: bool,
    optional: Sequence[str] | None = None,
    per_rank: str,
    cast: bool,
    executor: Executor,
    max_read_bytes: int,
    writes: TargetWrites | None = None,
    share: ReadShare | None = None,
    source: str | None = None,
    remedy: str | None = None,
    verify: bool = True,
    per_rank_call: str = PLAIN_CALL,
    logical: bool = True,
) -> RestoreStats:
    """Fill ``flat``'s leaves from ``manifest`` (in place), then run its finalizers.

    A finalizer (``load_state_dict`` of a stateful object) runs only when some leaf under its
    key was restored, so ``only=`` never hands an object its own current values back. Target
    keys matching ``optional`` that the checkpoint lacks are skipped without a word.

    Tensors are filled by the reads; objects and bytes are set, and finalizers run, only after
    every read succeeded. ``writes`` collects the target keys this attempt wrote; the keys an
    earlier attempt wrote (already in it) must all be restored by this one, or it raises
    before reading anything. ``share``: this rank's part in a replica-deduplicated restore
    (``restore/share.py``), which every rank of its group calls together; when this
    raises before the exchange, the caller's ``share.finish()`` joins it for this rank.

    ``source``, ``remedy``: how errors name what is read and what to do about damage (by
    default the step, and an earlier step); ``verify=False``: the source records no digests
    (a safetensors folder presented as a manifest, hf/view.py), its bytes are used as read.
    ``per_rank_call``: where the user sets ``per_rank``, for its messages. At another world
    size than the save's, rank 0 warns once what the policy did with the per-rank state.
    ``logical``: sum what was assembled for the check against the recorded logical digests
    (``stats.logical``, ``restore/logical_check.py``; judged by the caller).
    """
    writes = TargetWrites() if writes is None else writes
    source = source or f"step {manifest.step}"
    where = f"{storage.describe(step_dir)} ({source}, rank {rank})"
    plan = plan_restore(
        storage,
        manifest,
        flat,
        rank=rank,
        world_size=world_size,
        only=only,
        strict=strict,
        optional=optional,
        per_rank=per_rank,
        cast=cast,
        max_read_bytes=max_read_bytes,
        where=where,
        per_rank_call=per_rank_call,
    )
    stats = _planned(plan, manifest, where)
    reader, jobs, bytes_values = _prepare_reads(
        storage, step_dir, manifest, plan, writes, where, source, remedy, verify, max_read_bytes, share is not None
    )
    batches = _batches(reader, storage, jobs, share, executor, stats, manifest.step)
    wrote: set[str] = set()
    # (the tensors summed as their reads land, the rest after them: before the finalizers)
    check = plan_check(flat, manifest, plan.restored, rank=rank, world_size=world_size) if logical and verify else None
    try:
        _fill(executor, batches, stats, wrote, check, jobs)
        set_and_finalize(plan, flat, bytes_values, wrote, where)
    finally:
        writes.add(manifest.step, wrote)
    touched = set(plan.restored) | set(plan.dropped)
    warn_world_change(flat.per_rank_prefixes, touched, manifest, rank, world_size, storage.url, per_rank, per_rank_call)
    return stats


def _prepare_reads(
    storage: Storage,
    step_dir: str,
    manifest: Manifest,
    plan: RestorePlan,
    writes: TargetWrites,
    where: str,
    source: str,
    remedy: str | None,
    verify: bool,
    max_read_bytes: int,
    shared: bool,
) -> tuple[ChunkReader, list[Job], list[bytes]]:
    """The reader, the fill's jobs and the bytes leaves' values, once the checks that come
    before any read into the target passed (every rewritten key, every file's end);
    ``shared``: the ranks may share the reads (``restore/share.py``)."""
    stats = plan.stats
    reader = ChunkReader.of(
        storage,
        manifest,
        where=source,
        remedy=remedy
        or f"restore an earlier step (restore() without step= falls back by itself) and run "
        f"`shardkeeper verify {storage.url}`",
        verify=verify,
    )
    direct, reads, encoded = schedule(plan.ops, reader.block, stats.bytes_needed, max_read_bytes, shared=shared)
    _check_rewrites(writes, plan.restored, where, manifest.step)
    _check_file_ends(reader, step_dir, plan.ops)
    # Bytes leaves are read first but set only with the objects, once every read succeeded.
    bytes_values = [_bytes_of(reader, step_dir, rec, manifest.step, key, stats) for key, _, rec in plan.bytes_leaves]
    jobs = _jobs(step_dir, reader.block, direct, reads, encoded)
    return reader, jobs, bytes_values


def _planned(plan: RestorePlan, manifest: Manifest, where: str) -> RestoreStats:
    """The plan's stats, with the index files and pages its planning read; the warning of a
    ``strict=False`` restore whose target has keys the step lacks."""
    stats = plan.stats
    described = getattr(manifest.leaves, "described", None)
    stats.index_files = described.index_reads if described is not None else 0
    stats.pages = described.pages.reads if described is not None and described.pages is not None else 0
    if plan.missing:  # (strict: plan_restore raised)
        warnings.warn(
            f"strict=False: {len(plan.missing)} key(s) of the target state are not in {where} and "
            f"keep their current values: {missing_list(plan.missing)}",
            stacklevel=4,
        )
    return stats


def _batches(
    reader: ChunkReader,
    storage: Storage,
    jobs: list[Job],
    share: ReadShare | None,
    executor: Executor,
    stats: RestoreStats,
    step: int,
) -> Iterable[tuple[ChunkReader, Sequence[Job]]]:
    """The jobs as one batch, or, where the ranks share reads (``restore/share.py``), in
    rounds, each reading through the round's received pieces."""
    if share is None or not share.negotiate(jobs, step):
        return [(reader, jobs)]
    rounds = share.rounds(jobs, storage, executor, stats)
    return ((dataclasses.replace(reader, storage=st), js) for st, js in rounds)


def _fill(
    executor: Executor,
    batches: Iterable[tuple[ChunkReader, Sequence[Job]]],
    stats: RestoreStats,
    wrote: set[str],
    check: LogicalCheck | None,
    jobs: Sequence[Job],
) -> None:
    """Run every job of every round (even after a failure: the other ranks of a shared
    restore wait on each round), wait for each (none may still write afterwards), and raise
    the first failure; ``check``'s tensors are summed as their reads land, the rest after
    them, and it goes into ``stats``."""
    failed = threading.Event()
    sums = SumsAsFilled(check, jobs, failed) if check is not None else None
    errors: list[BaseException] = []
    try:
        with torch.no_grad():
            for rd, js in batches:
                futures = [
                    executor.submit(
                        _guarded(j.fn if sums is None else sums.wrap(j), failed), rd, j.path, j.item, stats, wrote
                    )
                    for j in js
                ]
                for f in futures:
                    try:
                        f.result()
                    except BaseException as e:
                        errors.append(e)
    finally:
        if sums is not None:
            sums.close()  # (its thread ends, whatever happened)
    if errors:
        raise errors[0]
    if check is not None:
        check.sum_rest()
        stats.logical = check


def _jobs(
    step_dir: str, block: int, direct: Sequence[Op], reads: Sequence[Read], encoded: Sequence[list[Op]]
) -> list[Job]:
    """The fill's calls, each with the file range it reads: large direct reads first (they
    dominate the time, small ones fill in behind them), then the coalesced, then the encoded."""
    jobs = []
    for op in sorted(direct, key=lambda o: o.start - o.end):
        c = op.chunk  # execute_direct reads the digest blocks that the op's bytes touch
        hi = min(-(-op.end // block) * block, c.length)
        jobs.append(
            Job(execute_direct, op, _join(step_dir, c.file), c.offset + op.start // block * block, c.offset + hi)
        )
    jobs += [Job(execute_read, rd, _join(step_dir, rd.file), rd.start, rd.end) for rd in reads]
    for eops in encoded:
        c = eops[0].chunk
        jobs.append(Job(execute_encoded, eops, _join(step_dir, c.file), c.offset, c.offset + c.length))
    return jobs


def _check_rewrites(writes: TargetWrites, restored: Sequence[str], where: str, step: int) -> None:
    """Before a fallback reads anything: it must rewrite every key an earlier attempt wrote,
    or those would keep a failed step's values next to this step's."""
    if not writes.keys:
        return
    lacking = sorted(writes.keys.difference(restored))
    if lacking:
        steps = ", ".join(map(str, writes.steps))
        raise CheckpointRestoreError(
            f"{len(lacking)} key(s) of the target were written while restoring step(s) {steps}, "
            f"which failed, and {where} does not hold them, so they would keep the values of "
            f"step(s) {steps}: {listing(lacking, 8)}; nothing of step {step} was read. Rebuild those "
            f"parts of the state and restore step {step} explicitly (restore(state, step={step}, "
            f"...)), or repair or delete step {steps}"
        )


def _check_file_ends(reader: ChunkReader, step_dir: str, ops: Sequence[Op]) -> None:
    """Before any read: every file exists and reaches the end a chunk of an op claims in it
    (one size query a file), so a hostile or damaged manifest fails before data is read."""
    ends: dict[str, tuple[int, str]] = {}
    for op in ops:
        end = op.chunk.offset + op.chunk.length
        if end > ends.get(op.chunk.file, (-1, ""))[0]:
            ends[op.chunk.file] = (end, op.key)
    storage = reader.storage
    for file, (end, key) in ends.items():
        path = _join(step_dir, file)
        if reader.missing_or_short(path, end):
            err = CorruptCheckpointError(
                f"{reader.where}: {storage.describe(path)} is missing or shorter than the {end} bytes "
                f"the manifest records for key {key!r}; the checkpoint is damaged: {reader.remedy}"
            )
            err.file = path  # (a restore's quarantine verifies it)
            raise err


def _bytes_of(reader: ChunkReader, step_dir: str, leaf: LeafRecord, step: int, key: str, stats: RestoreStats) -> bytes:
    """A bytes leaf, read whole and verified. No target sizes it, the manifest does: before
    allocating it, check that the files hold its chunks (validation bounded what each chunk's
    stored bytes decode to)."""
    storage = reader.storage
    why = stored_bytes_problem(leaf.chunks, lambda file: size_or_none(storage, _join(step_dir, file)))
    if why is not None:
        raise CorruptCheckpointError(
            f"step {step}: bytes leaf {key!r} ({math.prod(leaf.shape)} bytes) cannot be read from "
            f"{storage.describe(step_dir)}: {why}; the checkpoint is damaged: restore an earlier step and run "
            f"`shardkeeper verify {storage.url}`"
        )
    return read_bytes_leaf(reader, [_join(step_dir, c.file) for c in leaf.chunks], leaf, key, stats)


__all__ = ["TargetWrites", "log", "restore_flat"]
