"""``CheckpointManager``: save and restore a training state, on every rank.

A façade: it is made by ``build.py`` and holds a tier strategy (``tiers/strategy.py``: one tier
or two), which every call that differs between them goes through; its save side is
``save_calls.py``. The commit protocol and its records are ``commit/protocol.py``; a save's
caller-side and background halves ``save/runner.py`` (its handle ``save/handle.py``); restore
with fallback ``restore/restorer.py``; ``delete()`` ``lifecycle/delete.py``, retention after
each commit the strategy's save hooks (``save/hooks.py``). Save on every rank: plan ->
stage (caller's thread) -> write -> report (background) -> commit on the coordinator
(rank 0) -> retain. Restore on every rank: discover -> plan -> ranged, verified reads ->
copy in place; all ranks agree on the step and on success, and "restore the newest" falls
back to the previous committed step when a step is damaged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn

from shardkeeper.core.codec.keys import KeyProvider
from shardkeeper.core.commit.committed import load_manifest, newest_committed
from shardkeeper.core.config.arguments import check_manager_arguments, check_state, check_step
from shardkeeper.core.config.options import (
    DEFAULT,
    CheckpointOptions,
    Compression,
    DigestAlgorithm,
    KeepBest,
    LogicalCheck,
    PerRankPolicy,
    Staging,
    Writer,
)
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.manager import at_exit
from shardkeeper.core.manager.build import ManagerKeywords, ManagerParts, build_parts
from shardkeeper.core.manager.save_calls import SaveCalls
from shardkeeper.core.persist.locks import wait_for_commits
from shardkeeper.core.restore.load import load_step
from shardkeeper.core.restore.per_rank import PLAIN_CALL
from shardkeeper.core.restore.plan import RestoreStats
from shardkeeper.core.restore.request import RestoreRequest
from shardkeeper.core.save.handle import SaveHandle
from shardkeeper.core.save.job import outcome_timeout
from shardkeeper.core.storage import Storage
from shardkeeper.core.tiers.tiering import Tiering


class CheckpointManager(SaveCalls):
    """Durable, async, resharding checkpoints under one root (a path or an fsspec URL).

    In a process group every rank creates the manager (a collective) and calls ``save()`` /
    ``restore()`` with its own local state, as with ``torch.distributed.checkpoint``.

    Two tiers (docs/tiers.md): ``local`` (each node's own directory) takes every save, committed across the
    nodes without a shared file system; ``replicas`` (default 0) copies each rank's files to that many other
    nodes; ``erasure=(k, m)`` instead: m parity shards per k nodes; ``persist_every`` uploads a step to
    ``root`` once it is that many steps past the last uploaded one (None: never); ``local_keep`` keeps that
    many steps per node (None: all). Restore takes the newest step whole in some tier.
    """

    #: Where the user sets ``per_rank``, named by its messages; an adapter's managers name the
    #: adapter's call (``shardkeeper.core.adapter.RootManagers``).
    per_rank_call: str = PLAIN_CALL

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
        local: str | os.PathLike[str] | None = None,
        persist_every: int | None = None,
        replicas: int = 0,
        erasure: Sequence[int] | None = None,
        local_keep: int | None = None,
        # The fields of CheckpointOptions, one keyword each (a test holds them equal).
        async_save: bool = DEFAULT.async_save,
        staging: Staging = DEFAULT.staging,
        writer: Writer = DEFAULT.writer,
        per_rank: PerRankPolicy = DEFAULT.per_rank,
        share_restore_reads: bool = DEFAULT.share_restore_reads,
        digest: DigestAlgorithm = DEFAULT.digest,
        digest_block_bytes: int = DEFAULT.digest_block_bytes,
        logical_check: LogicalCheck = DEFAULT.logical_check,
        commit_timeout_s: float = DEFAULT.commit_timeout_s,
        commit_group_ranks: int = DEFAULT.commit_group_ranks,
        io_threads: int = DEFAULT.io_threads,
        max_files_per_rank: int = DEFAULT.max_files_per_rank,
        min_file_bytes: int = DEFAULT.min_file_bytes,
        data_prefixes: int | None = DEFAULT.data_prefixes,
        describe_layouts: bool | None = DEFAULT.describe_layouts,
        max_read_bytes: int = DEFAULT.max_read_bytes,
        catalog: str | None = DEFAULT.catalog,
        incremental: bool = DEFAULT.incremental,
        compression: Compression | None = DEFAULT.compression,
        compression_level: int = DEFAULT.compression_level,
        encryption: str | KeyProvider | None = DEFAULT.encryption,
        encryption_root: str | None = DEFAULT.encryption_root,
        retry_max_attempts: int = DEFAULT.retry_max_attempts,
        retry_base_delay_s: float = DEFAULT.retry_base_delay_s,
        retry_max_delay_s: float = DEFAULT.retry_max_delay_s,
        retry_deadline_s: float = DEFAULT.retry_deadline_s,
        save_every_steps: int | None = DEFAULT.save_every_steps,
        save_every_s: float | Literal["advised"] | None = DEFAULT.save_every_s,
        mtbf_s: float | None = DEFAULT.mtbf_s,
        keep_best: KeepBest | None = DEFAULT.keep_best,
        **unknown_options: NoReturn,
    ) -> None:
        """Open ``root`` (in a process group a collective: every rank, in the same order).

        ``keep_last`` / ``keep_every``: retention; ``process_group``: the ranks that save together (default: the world,
        or none; ``"local"``: this process alone, not a collective even in a process group, e.g. one rank that only
        loads); ``storage_options``: fsspec options of a URL root; ``metadata``: written into every manifest; ``local``,
        ``replicas``, ``erasure``, ``persist_every``, ``local_keep``: two tiers (see the class). Every other keyword is
        a field of :class:`CheckpointOptions` (docs/protocol.md, "Options"):

        - saving: ``async_save`` (return once staged), ``staging`` (blocking | overlap), ``writer``
          (thread | process: a persist process writes and commits), ``commit_timeout_s``,
          ``commit_group_ranks`` (ranks per group leader at larger worlds)
        - layout: ``max_files_per_rank``, ``min_file_bytes``, ``data_prefixes``, ``describe_layouts``; io: ``io_threads``, ``max_read_bytes``
        - restore: ``per_rank`` (per-rank state at another world size: map | exact | modulo | drop),
          ``share_restore_reads`` (a range several ranks restore is read once and sent to the others)
        - integrity: ``digest`` (xxh3_128 | sha256), ``digest_block_bytes``, ``logical_check`` (error | warn | off)
        - codecs: ``incremental``, ``compression`` ("zstd"), ``compression_level``,
          ``encryption`` ("env:VAR" | "file:PATH" | a KeyProvider), ``encryption_root``
        - retry: ``retry_max_attempts``, ``retry_base_delay_s``, ``retry_max_delay_s``, ``retry_deadline_s``;
          catalog: ``catalog`` (``etcd://host:2379``: record commits there too)
        - schedule (``should_save``): ``save_every_steps``, ``save_every_s`` (seconds, or
          ``"advised"``: the Young/Daly interval, with ``mtbf_s``)
        - retention: ``keep_best=(n, metric, mode)`` (the n best steps by ``metadata[metric]``,
          besides ``keep_last`` / ``keep_every``)

        Keywords override ``options=``. A wrong type is a ``TypeError``, a bad value a ``ValueError``, an unknown keyword a
        ``TypeError`` naming the close matches; all before the root is touched.
        """
        keywords = ManagerKeywords.checked(locals())  # check, build, assign
        check_manager_arguments(  # (called from here: its warning about the root names our caller)
            root=root, storage_options=storage_options, metadata=metadata, options=options, process_group=process_group
        )
        self._assign(build_parts(root, keywords, options, storage_options, metadata, process_group))

    def _assign(self, parts: ManagerParts) -> None:
        """Hold the built ``parts``, no save pending yet, and have the exit hook wait for this
        manager's saves (``at_exit``)."""
        self.options, self.retention, self.metadata = parts.options, parts.retention, parts.metadata
        self.storage, self.rank, self.world_size = parts.storage, parts.coord.rank, parts.coord.world_size
        self._ctx, self._coord, self._io, self._bg = parts.ctx, parts.coord, parts.io, parts.bg
        self._saver, self._stager, self._plans, self._gate = parts.saver, parts.stager, parts.plans, parts.gate
        self._strategy = parts.strategy  # one tier or two (tiers/strategy.py)
        self._tiers = parts.tiering  # the two tiers' state, or None (``tiering``)
        self._schedule = parts.schedule  # should_save (schedule.py)
        self._pending, self._seq, self._closed = None, 0, False
        at_exit.track(self)

    @property
    def last_restore_stats(self) -> RestoreStats | None:
        """What the last restore attempt that succeeded on this rank read (keys, bytes)."""
        return self._strategy.last_stats

    @property
    def last_restore_tier(self) -> str | None:
        """With a local tier: ``"local"`` or ``"persistent"``, where the last restore read from."""
        return self._strategy.last_tier

    @property
    def persistent_reads(self) -> int:
        """With a local tier: bytes this rank's restores read from the persistent root."""
        return self._strategy.persistent_reads

    @property
    def persisted_steps(self) -> list[int]:
        """With a local tier: the steps this manager has uploaded and committed to the
        persistent root so far, sorted, each once (an upload still running is not listed)."""
        return self._strategy.persisted_steps()

    def wait_persisted(self) -> None:
        """With a local tier: block until the running upload to the persistent root ends;
        raise its failure (``CheckpointSaveError``; the step stays in the local tier)."""
        self._wait_pending(raise_error=True)
        self._strategy.wait_persisted()

    @property
    def tiering(self) -> Tiering | None:
        """With a local tier: the two tiers' state (the persistent root, the uploads to it,
        which with ``writer="process"`` run in the persist process instead: ask
        ``persisted_steps``, ``upload_newest``); None with one tier."""
        return self._tiers

    # -- what is committed; delete -----------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (reads and validates every manifest of the root: to ask
        about one step or the newest, ``is_committed`` and ``latest_step`` read one)."""
        return self._strategy.steps()  # with a local tier: this node's and the persistent root's

    def latest_step(self) -> int | None:
        """The newest committed step, or None; manifests are validated newest first only until
        one validates. With a local tier: the newest of this node's and the persistent root's."""
        self._settle()
        return self._strategy.latest()

    def _settle(self) -> None:
        """Before the newest step is chosen: wait for the saves that persist processes of an
        earlier trainer on this node still commit (``persist/locks.py``)."""
        timeout_s = outcome_timeout(self.options.commit_timeout_s)
        wait_for_commits(self.storage.url, self._saver.lock_namespace, timeout_s, rank=self.rank)

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed under the root (its manifest exists and validates);
        with a local tier, in this node's directory or the persistent root."""
        step = check_step("is_committed", step)
        return self._strategy.is_committed(step)

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (None: the newest committed): its leaves (keys,
        kinds, shapes, dtypes), world size and metadata, without reading any tensor data."""
        self._check_open()
        step = check_step("manifest", step, optional=True)
        ctx = self._strategy.reader(step)
        if step is None:
            step = newest_committed(ctx.storage)
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.storage.url} (rank {self.rank})")
        return load_manifest(ctx.read_storage, step)  # authenticated when encrypted

    def step_url(self, step: int) -> str:
        """Where ``step``'s directory lives (a path or URL), for messages and other tools."""
        step = check_step("step_url", step)
        return self.storage.describe(step_dir(step))

    def agree(self, value: int, op: str = "bcast") -> int:
        """``value`` as every rank of the manager's process group agrees on it: rank 0's
        (``op="bcast"``), or the largest (``"max"``) or smallest (``"min"``) of all ranks'.
        A collective: call it on every rank, on the caller's thread (adapters decide a save's
        step with it)."""
        self._check_open()
        where = f"(root {self.storage.url}, rank {self.rank})"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"agree(): value must be an int, not {type(value).__name__} {where}")
        if op not in ("bcast", "max", "min"):
            raise ValueError(f"agree(): op must be 'bcast', 'max' or 'min', got {op!r} {where}")
        return value if self.world_size == 1 else self._coord.agree_int(value, op)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step`` by the schedule the options give: every
        ``save_every_steps`` steps, every ``save_every_s`` seconds, or ``save_every_s="advised"``
        (the Young/Daly interval from the root's recorded save timings and ``mtbf_s``). The same
        answer on every rank: call it on every rank with the same steps; a time schedule is
        rank 0's clock, agreed at a few steps per interval by a broadcast (``schedule.py``).
        False at or below the newest step this manager saved or restored; without a schedule
        a ``ValueError``."""
        self._check_open()
        return self._schedule.should_save(step)

    def delete(self, step: int, *, damaged: bool = False) -> bool:
        """Delete committed ``step`` with retention's guarantees; True if it is gone.

        Call it on every rank (a collective); the coordinator deletes. This manager's pending
        save is waited for first (its failure stays for the next ``wait()``), so it never races
        the deletion; a commit of another process that references ``step`` keeps the files it
        needs (``commit/intents.py``). Never deletes the newest committed step, nor files that another
        retained step references (returns False for the newest: ask again later). A step that
        is not committed counts as gone; one whose manifest cannot be read is not deleted
        (False, with a warning: see ``shardkeeper verify``).

        ``damaged=True`` deletes a damaged step, the newest one included (a run whose newest
        step is damaged can save there again only once it is gone): the step is verified
        first (every file and digest) and deleted only if its manifest does not validate or
        its data is missing or differs; an intact step, one the storage could not be asked
        about, or one of a newer format raises ``ValueError`` with nothing deleted.
        """
        self._check_open()
        step = check_step("delete", step)
        if not isinstance(damaged, bool):
            raise TypeError(f"delete(damaged=...) must be True or False, not {damaged!r}")
        self._wait_pending(raise_error=False)
        return self._strategy.delete(step, damaged=damaged)

    # -- restore -----------------------------------------------------------------------------
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
        A :class:`~shardkeeper.core.format.progress.ProgressTarget` entry (an adapter's ``progress``) is
        handed the restored step's progress, read from its manifest (any framework's layout),
        when ``only`` selects ``progress/``.
        A target that holds nothing to fill (``{}``) is a ``ValueError``: to read a checkpoint
        without a model, use :meth:`load`.
        """
        self._check_open()
        check_state("restore", state)
        request = RestoreRequest.checked(
            step,
            only,
            strict=strict,
            per_rank=per_rank,
            cast_dtypes=cast_dtypes,
            optional=optional,
            default_per_rank=self.options.per_rank,
            per_rank_call=self.per_rank_call,
        )
        self._wait_pending(raise_error=False)
        self._settle()
        restored = self._strategy.restore(state, request)
        self._schedule.mark(restored)
        return restored

    def load(
        self,
        step: int | None = None,
        *,
        only: str | Sequence[str] | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """``step`` (None: the newest committed) read into a NEW nested dict, without a target.

        Like ``torch.load``: full CPU tensors in their saved dtype (assembled from every
        saving rank's shards, whatever the layout), JSON values and bytes, nested by the ``/``
        key paths (``load()["model"]["fc.weight"]``); per-rank state one entry per saving rank
        (``load()["rng"]["0"]``). ``only``: key patterns, as ``restore``'s. ``max_bytes``:
        refuse up front when the selection takes more memory (None: no bound). Not a
        collective: one process may call it alone. Reads are verified; a damaged step raises.
        """
        self._check_open()
        step = check_step("load", step, optional=True)
        patterns = [only] if isinstance(only, str) else (list(only) if only else None)
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"load(): max_bytes must be an int >= 0 or None (no bound), got {max_bytes!r}")
        self._wait_pending(raise_error=False)
        out, _ = load_step(self._strategy.reader(step), step, patterns, max_bytes)
        return out

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the pending save as ``wait()`` does, then release the manager's threads.

        Raises the pending save's failure if nobody has seen it (the manager is closed all the
        same). Idempotent; after it, every other method raises ``CheckpointError``. A Ctrl-C
        during the wait propagates at once and leaves the manager open: the save goes on and
        is still waited for at exit. ``with CheckpointManager(...) as mgr:`` calls it.
        """
        if self._closed:
            return
        try:
            self.wait_persisted()
        except Exception:
            self._shutdown()
            raise
        self._shutdown()

    def _shutdown(self) -> None:
        self._gate.close()
        self._closed = True
        at_exit.untrack(self)
        self._bg.shutdown(wait=True)
        self._saver.close()  # (a persist process: after its last save)
        self._strategy.close()
        self._io.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            return  # Ctrl-C / SystemExit: propagate at once; the exit still waits for the save
        self.close()


__all__ = ["CheckpointManager", "CheckpointOptions", "SaveHandle"]
