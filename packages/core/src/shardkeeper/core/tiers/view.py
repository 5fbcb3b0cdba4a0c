"""What the manager needs to open two tiers: the options they allow, both roots, and the
persistent root seen as a plain manager's (a context and a restorer of its own)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.commit import manifest_path
from shardkeeper.core.context import ManagerContext
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.options import CheckpointOptions
from shardkeeper.core.restoring import Restorer
from shardkeeper.core.root_files import remove_file, walk_files
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tiers.tiering import Opened, Tiering, local_root, open_tier

log = logging.getLogger(__name__)


def check_tier_options(options: CheckpointOptions) -> CheckpointOptions:
    """The options with a local tier: chunks always enumerated in the manifest (no per-rank
    index files or pages, which would live on one node only); incremental saves refused."""
    if options.incremental:
        raise ValueError(
            "CheckpointManager(local=...): incremental=True is not supported with a local tier (an incremental "
            "step references earlier steps' files, which a replaced node or a retained tier may lack); drop one"
        )
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
    return open_tier(local_root(local), None, retry, options.encryption, binding), persistent


@dataclass
class TierView:
    """The persistent root as a plain manager sees it."""

    ctx: ManagerContext
    restorer: Restorer

    @classmethod
    def of(cls, tiers: Tiering, coord: Any, settings: Any, io: Any) -> TierView:
        p = tiers.persistent
        ctx = ManagerContext(p.storage, p.read, coord, settings, io, p.encryption)
        return cls(ctx, Restorer(ctx))


def drop_step(storage: Storage, step: int) -> None:
    """Remove a local step that no tier can restore whole: its manifest first (it is no
    longer committed), then its files."""
    try:
        storage.delete(manifest_path(step))
        for path in walk_files(storage, step_dir(step)):
            remove_file(storage, path)
        storage.delete_dir(step_dir(step))
    except CheckpointError as e:
        log.warning("could not remove %s: %s", storage.describe(step_dir(step)), e)


__all__ = ["TierView", "check_tier_options", "drop_step", "open_tiers"]
