"""``ShardkeeperTrainer``: a ``transformers.Trainer`` whose checkpoints are shardkeeper's."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.transformers.plugin import enable, refuse_push_to_hub
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
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "push_to_hub", False):  # refused before the Trainer makes the hub repo
            refuse_push_to_hub()
        super().__init__(*args, **kwargs)
        enable(self, shardkeeper_root, **(shardkeeper_options or {}))


__all__ = ["ShardkeeperTrainer"]
