"""Removing a local step that no tier holds whole (after a restore chose an older one)."""

from __future__ import annotations

import logging

from shardkeeper.core.commit.committed import manifest_path
from shardkeeper.core.commit.files import remove_file, walk_files
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


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


__all__ = ["drop_step"]
