"""shardkeeper adapter for the Hugging Face ``Trainer``.

``ShardkeeperTrainer(...)`` (or ``shardkeeper.transformers.enable(trainer)``) makes every
checkpoint the Trainer saves a shardkeeper step (committed whole or not at all) in the
canonical namespaces (``model``, ``optim``, ``sched``, ``progress``, ``rng``, ``extra``), shown
once committed as ``output_dir/checkpoint-N`` (no tensors in it) for ``get_last_checkpoint``, and
``train(resume_from_checkpoint=True)`` resume from the newest committed one. They restore in
plain torch through the core and in the other adapters. Imports only the public API of
shardkeeper.core, transformers and accelerate, never another adapter.
"""

from __future__ import annotations

from shardkeeper.transformers.export import export_pretrained
from shardkeeper.transformers.plugin import TrainerPlugin, disable, enable, plugin_of, wait
from shardkeeper.transformers.trainer import ShardkeeperTrainer

__all__ = ["ShardkeeperTrainer", "TrainerPlugin", "disable", "enable", "export_pretrained", "plugin_of", "wait"]
