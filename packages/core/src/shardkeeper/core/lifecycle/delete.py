"""A manager removing committed steps: retention after each commit, and ``delete()``.

Both run on the coordinator (rank 0) with ``retention.apply_retention``'s guarantees (never
the newest committed step, never a file another retained step or a commit in progress
references) and drop the deleted steps from the catalog. ``delete()`` is a collective: the
coordinator deletes and broadcasts a ``protocol.Deletion`` (and, when it failed, its error's
type and message, which every rank raises); ``delete(step, damaged=True)``
verifies the step and deletes it, the newest included, only if it is damaged.
"""

from __future__ import annotations

import logging

from shardkeeper.core import metrics
from shardkeeper.core.commit.catalog import forget_deleted
from shardkeeper.core.commit.committed import committed_steps, manifest_steps
from shardkeeper.core.commit.protocol import COORDINATOR, Deletion
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    EncryptionKeyError,
    IncompatibleFormatError,
    StorageError,
)
from shardkeeper.core.lifecycle.delete_damaged import delete_damaged
from shardkeeper.core.lifecycle.retention import DeleteOnly, RetentionPolicy, apply_retention
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


def retain(storage: Storage, policy: RetentionPolicy, catalog: str | None, step: int) -> None:
    """Coordinator, after committing ``step``: apply ``policy``. Never fails the save."""
    if policy.keeps_all:
        return
    try:
        deleted = apply_retention(storage, policy, protect=[step])
    except Exception as e:  # retention must never fail a committed save
        metrics.record(metrics.AFTER_COMMIT_ERRORS, 1, step=step, what="retention")
        log.warning("retention after step %d failed (will retry after the next save): %s", step, e)
    else:
        forget_deleted(catalog, storage, deleted, after_commit=step)  # (within the commit's catalog deadline)


def delete_step(ctx: ManagerContext, step: int, *, damaged: bool = False) -> bool:
    """Every rank: the coordinator deletes committed ``step``; True on every rank if it is gone.
    ``damaged``: verify it first and delete it, the newest included, only if it is damaged
    (``lifecycle/delete_damaged.py``)."""
    result, err = Deletion.KEPT, None
    if ctx.rank == COORDINATOR and damaged:
        try:
            found = delete_damaged(ctx.storage, step, read_storage=ctx.read_storage, catalog=ctx.settings.catalog)
            log.warning("deleted damaged step %d under %s: %s", step, ctx.storage.url, "; ".join(found.damage))
            result = Deletion.GONE
        except Exception as e:
            result, err = Deletion.FAILED, e
    elif ctx.rank == COORDINATOR:
        try:
            deleted = apply_retention(ctx.storage, DeleteOnly(frozenset([step])))
            forget_deleted(ctx.settings.catalog, ctx.storage, deleted)
            # Listed by its manifest's name: a step whose manifest cannot be read is not gone
            # (retention, which reads manifests, leaves it; a save at that step stays refused).
            result = Deletion.KEPT if step in manifest_steps(ctx.storage) else Deletion.GONE
            if result is Deletion.KEPT and step not in committed_steps(ctx.storage):
                log.warning(
                    "step %d under %s was not deleted: its manifest cannot be read (`shardkeeper verify` on the "
                    "root names the damage; delete(step, damaged=True) deletes a damaged step)",
                    step,
                    ctx.storage.url,
                )
        except Exception as e:
            result, err = Deletion.FAILED, e
    if ctx.world_size > 1:
        result = Deletion(ctx.coord.agree_int(result, "bcast"))
        if result is Deletion.FAILED:  # every rank raises the coordinator's error, with its reason
            said = ctx.coord.agree_text(f"{type(err).__name__}\n{err}" if err is not None else "")
            if err is None:
                kind, _, why = said.partition("\n")
                raise _SAID_TYPES.get(kind, CheckpointError)(
                    f"{why} (the coordinator, rank 0, which deletes, said so; rank {ctx.rank})"
                )
    if err is not None:
        raise err
    return result is Deletion.GONE


#: The errors a coordinator's deletion raises that another rank raises as the same type
#: (a refusal: ``ValueError``; no such step; the key; the storage); any other: ``CheckpointError``.
_SAID_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        ValueError,
        CheckpointNotFoundError,
        EncryptionKeyError,
        StorageError,
        CorruptCheckpointError,
        ChecksumMismatchError,
        IncompatibleFormatError,
    )
}


__all__ = ["DeleteOnly", "delete_step", "retain"]
