"""``TwoTiers``: the tier strategy (``strategy.py``) of a manager with a node-local tier in
front of the persistent root. Its save hooks are ``Tiering``'s (``tiering.py``); restore is
``restore.py``'s; the persistent root is also seen as a plain manager sees it (a context and a
restorer of its own), for one process's reads and for ``delete()`` over both tiers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from shardkeeper.core.commit.committed import committed_steps, is_committed, manifest_steps, newest_committed
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.restore.plan import RestoreStats
from shardkeeper.core.restore.request import RestoreRequest
from shardkeeper.core.restore.restorer import Restorer
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.save.hooks import Committed
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.choose import LOCAL, covers, required_files
from shardkeeper.core.tiers.persist import Persister
from shardkeeper.core.tiers.restore import restore_tiered
from shardkeeper.core.tiers.tiering import Tiering

log = logging.getLogger(__name__)


class TwoTiers:
    """The two tiers of one manager: ``local`` its context on this node's directory,
    ``persistent`` the persistent root's, ``tiers`` their state (``Tiering``)."""

    tiered = True

    def __init__(self, local: ManagerContext, tiers: Tiering) -> None:
        p = tiers.persistent
        self.local, self.tiers = local, tiers
        self.persistent = ManagerContext(p.storage, p.read, local.coord, local.settings, local.io, p.encryption)
        self.restorer, self.persistent_restorer = Restorer(local), Restorer(self.persistent)
        self.last_tier: str | None = None
        self.persistent_reads = 0
        self._last_restorer = self.restorer
        #: The uploads (``join``, ``wait``, ``persisted``, ``upload_newest``): the tiers' own, or with
        #: ``writer="process"`` the persist process's, asked over its channel (``persist/uploads.py``).
        self.uploads: Any = tiers.persister

    # -- the save's hooks (save/hooks.py) ----------------------------------------------------
    @property
    def other_root(self) -> Storage:
        return self.persistent.storage

    @property
    def checked(self) -> Callable[[str], bool]:
        return self.tiers.checked_here

    def after_write(self, step: int, files: Mapping[str, int] | None) -> None:
        self.tiers.replicate(step, files)

    def before_commit(self, seq: int, step: int, attempt: str, data: bytes) -> None:
        self.tiers.before_commit(seq, step, attempt, data)

    def commit_failed(self, seq: int) -> None:
        self.tiers.recorder.forget(seq)

    def after_commit(self, seq: int, step: int, committed: Committed, retention: RetentionPolicy) -> None:
        """``Tiering.after_commit`` (the persistent root's retention is the one the tiers were
        made with, applied after each upload)."""
        self.tiers.after_commit(seq, step, committed)

    # -- what is committed, and where one process reads it -----------------------------------
    @property
    def url(self) -> str:
        return self.persistent.storage.url

    def steps(self) -> list[int]:
        """Committed in this node's directory or the persistent root, ascending."""
        return sorted(set(committed_steps(self.local.storage)) | set(committed_steps(self.persistent.storage)))

    def latest(self) -> int | None:
        found = [
            s
            for s in (newest_committed(self.local.storage), newest_committed(self.persistent.storage))
            if s is not None
        ]
        return max(found) if found else None

    def is_committed(self, step: int) -> bool:
        """In the persistent root or this node's directory."""
        return is_committed(self.persistent.storage, step) or is_committed(self.local.storage, step)

    def reader(self, step: int | None) -> ManagerContext:
        """Where one process reads ``step`` (None: the newest of both): this node's directory
        when it holds the step whole (with ``replicas=0`` a node rarely does), else the
        persistent root."""
        local = self.local
        if step is None:
            mine, remote = newest_committed(local.storage), newest_committed(self.persistent.storage)
            if mine is None or (remote is not None and remote > mine):
                return self.persistent
            step = mine
        try:
            need = required_files(local.read_storage, step)
            whole = all(covers(local.storage.size(p), n) for p, n in need.items())
        except CheckpointError:
            whole = False
        return local if whole or not is_committed(self.persistent.storage, step) else self.persistent

    def delete(self, step: int, *, damaged: bool) -> bool:
        """Collective: ``step`` deleted from the persistent root (as without tiers) and from
        every node's directory. ``damaged=True`` judges the persistent copy when there is one
        (a node's copy alone lacks the other nodes' files); a step only the local tiers hold
        is deleted from every node only when they do not hold it whole together."""
        tiers, ctx = self.tiers, self.persistent
        self.uploads.join()  # an upload of ``step`` that is running would commit it after the delete
        persisted = step in manifest_steps(ctx.storage) if ctx.rank == 0 else False
        persisted = bool(tiers.group.all_reduce_max([int(persisted)], "whether the step is persisted")[0])
        gone = True
        if persisted or not damaged:
            gone = deletion.delete_step(ctx, step, damaged=damaged)
        if damaged and not persisted and tiers.whole_locally(step):
            raise ValueError(
                f"step {step} is whole in the local tiers (every file at its size on some node), so it is not "
                f"deleted as damaged; restore() checks its bytes and falls back from a damaged copy"
            )
        gone = tiers.delete_local(step, force=damaged) and gone
        if gone and ctx.rank == 0:
            tiers.claims.release(step)  # (this job's claim of it: no tier holds the step now)
        return gone

    # -- restore; the persistent uploads; close ----------------------------------------------
    def restore(self, state: Mapping[str, Any], request: RestoreRequest) -> int:
        """``restore.restore_tiered``, once the running upload ended (its failure stays for
        ``wait_persisted``); counts the bytes read from the persistent root."""
        try:
            self.uploads.join()
        except CheckpointError as e:  # (a persist process that died: raised by ``wait_persisted``)
            log.warning(
                "rank %d: the running upload could not be waited for before the restore: %s", self.local.rank, e
            )
        got = restore_tiered(self.tiers, self.restorer, self.persistent_restorer, state, request, self.uploads)
        self._last_restorer, self.last_tier = got.restorer, got.tier
        stats = got.restorer.last_stats
        if stats is not None:
            stats.rebuilt = list(self.tiers.mend.rebuilt)
        if got.tier != LOCAL and stats is not None:
            self.persistent_reads += stats.bytes_read
        return got.step

    @property
    def last_stats(self) -> RestoreStats | None:
        return self._last_restorer.last_stats

    def persisted_steps(self) -> list[int]:
        return sorted(set(self.uploads.persisted))  # (a step uploaded again after a quarantine: once)

    def wait_persisted(self) -> None:
        self.uploads.wait()

    def upload_newest(self, timeout_s: float) -> tuple[int | None, bool]:
        """``Tiering.upload_newest`` where the uploads run: these tiers', or with
        ``writer="process"`` the persist process's (which raises when it has ended)."""
        up = self.uploads
        return self.tiers.upload_newest(timeout_s) if isinstance(up, Persister) else up.upload_newest(timeout_s)

    def close(self) -> None:
        self.tiers.close()


__all__ = ["TwoTiers"]
