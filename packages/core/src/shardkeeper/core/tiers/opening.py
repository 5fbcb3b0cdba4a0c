"""What the manager needs to open two tiers: the options they allow, both roots, and the
persistent root seen as a plain manager's (a context and a restorer of its own)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.commit.committed import committed_steps, is_committed, manifest_steps, newest_committed
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.lifecycle import delete as deletion
from shardkeeper.core.restore.restorer import Restorer
from shardkeeper.core.runtime.binding import refuse_local_tier
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.tiers.choose import covers, required_files
from shardkeeper.core.tiers.tee import Tee
from shardkeeper.core.tiers.tiering import Opened, Tiering, local_root, open_tier

log = logging.getLogger(__name__)


def check_tier_options(options: CheckpointOptions) -> CheckpointOptions:
    """The options with a local tier: chunks always enumerated in the manifest (no per-rank
    index files or pages, which would live on one node only)."""
    if options.describe_layouts:
        raise ValueError(
            "CheckpointManager(local=...): describe_layouts=True writes per-rank index files that live on one node; "
            "with a local tier the chunks are listed in the manifest: pass describe_layouts=None or False"
        )
    return options.replace(describe_layouts=False)


def open_tiers(
    root: Any, local: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, options: CheckpointOptions
) -> tuple[Opened, Opened]:
    """(local, persistent): both encrypted alike and bound to the persistent root's name, so
    that a local file uploaded as it is reads back under the persistent root."""
    retry = options.retry_policy()
    persistent = open_tier(root, storage_options, retry, options.encryption, options.encryption_root)
    binding = persistent.encryption.binding if persistent.encryption is not None else None
    local_store = local_root(local)
    _refuse_nested(local_store.url, persistent.raw.url)
    refuse_local_tier(persistent.raw)
    tee = Tee(local_store)
    opened = open_tier(tee, None, retry, options.encryption, binding)
    return dataclasses.replace(opened, tee=tee), persistent


def _refuse_nested(local: str, root: str) -> None:
    """The local tier inside the persistent root (or around it) would have each tier's
    retention and uploads manage the other's files."""
    if "://" in root and not root.startswith("file://"):
        return
    a = os.path.realpath(local)
    b = os.path.realpath(root[len("file://") :] if root.startswith("file://") else root)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ValueError(
            f"CheckpointManager(): local={local!r} is {'the root' if a == b else 'inside the root' if a.startswith(b) else 'around the root'} "
            f"{root!r}; the local tier is a directory of its own on each node's disk or RAM (e.g. /local_nvme/run)"
        )


@dataclass
class TierView:
    """The persistent root as a plain manager sees it, and the manager's one-process reads
    and its ``delete()`` over both tiers."""

    ctx: ManagerContext
    restorer: Restorer
    tiers: Tiering

    @classmethod
    def of(cls, tiers: Tiering, coord: Any, settings: Any, io: Any) -> TierView:
        p = tiers.persistent
        ctx = ManagerContext(p.storage, p.read, coord, settings, io, p.encryption)
        return cls(ctx, Restorer(ctx), tiers)

    def steps(self, local: ManagerContext) -> list[int]:
        """Committed in this node's directory or the persistent root, ascending."""
        return sorted(set(committed_steps(local.storage)) | set(committed_steps(self.ctx.storage)))

    def latest(self, local: ManagerContext) -> int | None:
        found = [s for s in (newest_committed(local.storage), newest_committed(self.ctx.storage)) if s is not None]
        return max(found) if found else None

    def ctx_for(self, local: ManagerContext, step: int | None) -> ManagerContext:
        """Where one process reads ``step`` (None: the newest of both): this node's directory
        when it holds the step whole (with ``replicas=0`` a node rarely does), else the
        persistent root."""
        if step is None:
            mine, remote = newest_committed(local.storage), newest_committed(self.ctx.storage)
            if mine is None or (remote is not None and remote > mine):
                return self.ctx
            step = mine
        try:
            need = required_files(local.read_storage, step)
            whole = all(covers(local.storage.size(p), n) for p, n in need.items())
        except CheckpointError:
            whole = False
        return local if whole or not is_committed(self.ctx.storage, step) else self.ctx

    def delete(self, step: int, *, damaged: bool) -> bool:
        """Collective: ``step`` deleted from the persistent root (as without tiers) and from
        every node's directory. ``damaged=True`` judges the persistent copy when there is one
        (a node's copy alone lacks the other nodes' files); a step only the local tiers hold
        is deleted from every node only when they do not hold it whole together."""
        self.tiers.persister.join()  # an upload of ``step`` that is running would commit it after the delete
        persisted = step in manifest_steps(self.ctx.storage) if self.ctx.rank == 0 else False
        persisted = bool(self.tiers.group.all_reduce_max([int(persisted)], "whether the step is persisted")[0])
        gone = True
        if persisted or not damaged:
            gone = deletion.delete_step(self.ctx, step, damaged=damaged)
        if damaged and not persisted and self.tiers.whole_locally(step):
            raise ValueError(
                f"step {step} is whole in the local tiers (every file at its size on some node), so it is not "
                f"deleted as damaged; restore() checks its bytes and falls back from a damaged copy"
            )
        gone = self.tiers.delete_local(step, force=damaged) and gone
        if gone and self.ctx.rank == 0:
            self.tiers.claims.release(step)  # (this job's claim of it: no tier holds the step now)
        return gone


__all__ = ["TierView", "check_tier_options", "open_tiers"]
