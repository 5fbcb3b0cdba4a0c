"""shardkeeper adapter for Hugging Face Accelerate.

``shardkeeper.accelerate.enable(accelerator)`` (or ``ShardkeeperAccelerator(...)``) makes
``accelerator.save_state()`` / ``load_state()`` write and read shardkeeper checkpoints in the
canonical namespaces (``model``, ``optim``, ``sched``, ``progress``, ``rng``, ``data``,
``extra``), so they restore in plain torch through the core and in the other adapters. Imports
only the public API of shardkeeper.core and accelerate, never another adapter.
"""

from __future__ import annotations

from shardkeeper.accelerate.accelerator import ShardkeeperAccelerator
from shardkeeper.accelerate.config import config_file_path
from shardkeeper.accelerate.legacy import import_accelerate_checkpoint
from shardkeeper.accelerate.plugin import AcceleratePlugin, disable, enable, plugin_of, wait

__all__ = [
    "AcceleratePlugin",
    "ShardkeeperAccelerator",
    "config_file_path",
    "disable",
    "enable",
    "import_accelerate_checkpoint",
    "plugin_of",
    "wait",
]
