"""What the manager needs to open two tiers: the options they allow, and both roots."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.runtime.binding import refuse_local_tier
from shardkeeper.core.tiers.tee import Tee
from shardkeeper.core.tiers.tiering import Opened, local_root, open_tier

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


__all__ = ["check_tier_options", "open_tiers"]
