"""``ShardkeeperTrainer``: a ``transformers.Trainer`` whose checkpoints are shardkeeper's."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.transformers.plugin import enable
from transformers import Trainer


class ShardkeeperTrainer(Trainer):
    """A ``Trainer`` with :func:`~shardkeeper.transformers.enable` applied at construction.

    ``shardkeeper_root``: where checkpoints go (default: ``args.output_dir``);
    ``shardkeeper_options``: ``CheckpointManager`` options (``async_save``, ``compression``, ...).
    Every other argument is the Trainer's.
    """

    def __init__(
        self,
        *args: Any,
        shardkeeper_root: str | os.PathLike[str] | None = None,
        shardkeeper_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        enable(self, shardkeeper_root, **(shardkeeper_options or {}))


__all__ = ["ShardkeeperTrainer"]
