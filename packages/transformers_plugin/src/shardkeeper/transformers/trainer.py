"""``ShardkeeperTrainer``: a ``transformers.Trainer`` whose checkpoints are shardkeeper's."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.transformers.plugin import enable, refuse_push_to_hub
from shardkeeper.transformers.state import sharded_at_load
from transformers import Trainer


class ShardkeeperTrainer(Trainer):
    """A ``Trainer`` with :func:`~shardkeeper.transformers.enable` applied at construction.

    ``shardkeeper_root``: where checkpoints go (default: ``args.output_dir``);
    ``shardkeeper_options``: ``CheckpointManager`` options (``async_save``, ``compression``, ...).
    Every other argument is the Trainer's.

    A model sharded at load time (``from_pretrained(distributed_config=...)``: FSDP2 or tensor
    parallel) checkpoints whole here: the Trainer alone refuses to save its optimizer (it
    cannot checkpoint DTensor optimizer state), which shardkeeper saves and reshards.
    """

    def __init__(
        self,
        *args: Any,
        shardkeeper_root: str | os.PathLike[str] | None = None,
        shardkeeper_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        training_args: Any = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "push_to_hub", False):  # refused before the Trainer makes the hub repo
            refuse_push_to_hub()
        model = kwargs.get("model", args[0] if args else None)
        lift = training_args is not None and sharded_at_load(model) and not training_args.save_only_model
        if lift:  # the Trainer's refusal to save such a model's optimizer: shardkeeper saves it
            training_args.save_only_model = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            if lift:
                training_args.save_only_model = False
        enable(self, shardkeeper_root, **(shardkeeper_options or {}))


__all__ = ["ShardkeeperTrainer"]
