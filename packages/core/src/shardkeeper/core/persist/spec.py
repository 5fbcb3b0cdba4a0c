"""What a persist process is told once, at its start: the ``PersistSpec`` it rebuilds the
manager's writer from (checked on the trainer's side when the manager is made: ``build.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardkeeper.core.config.options import CheckpointOptions


@dataclass(frozen=True)
class PersistSpec:
    """The manager a persist process writes for: its root (as given), storage options and
    options; its rank and world; its coordinator's namespace and, with several ranks, the
    address of the c10d store server the persist processes meet on. With a node-local tier,
    ``tiers`` holds its keywords (``local`` a path, ``persist_every``, ``replicas``,
    ``local_keep``, ``erasure``, the persistent root's ``retention``) and ``entry`` names the
    module the persist process runs (one that knows the tiers: ``tiers/process_writer.py``)."""

    root: Any
    storage_options: dict[str, Any]
    options: CheckpointOptions
    rank: int
    world_size: int
    namespace: str = ""
    store: tuple[str, int] | None = None
    group_ranks: int = 128
    tiers: dict[str, Any] | None = None
    entry: str = "shardkeeper.core.persist.worker"


__all__ = ["PersistSpec"]
