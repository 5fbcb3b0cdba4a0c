"""shardkeeper adapter for PyTorch Lightning.

``Trainer(plugins=[ShardkeeperCheckpointIO(root)])`` makes every checkpoint the Trainer saves
(``ModelCheckpoint``, ``trainer.save_checkpoint``) a shardkeeper checkpoint under ``root``, and
``fit(ckpt_path=...)`` restore from one, under ddp, ``ModelParallelStrategy`` (FSDP2, TP),
``FSDPStrategy`` (sharded) and ``DeepSpeedStrategy`` (through the DeepSpeed adapter's
``engine_state``). :func:`import_lightning_checkpoint` imports a ``.ckpt`` or a sharded (DCP) directory. See docs/lightning.md. Importing this module installs the hook
that connects the plugin to its strategy (:mod:`shardkeeper.lightning.hook`); ``uninstall()``
removes it and ``disconnect(plugin)`` gives a connected strategy its own methods back.
The hook also makes ``LightningModule.load_from_checkpoint("last.ckpt")`` and
``trainer.test(model, ckpt_path="last.ckpt")`` read the plugin's pointer files;
:func:`load_checkpoint` returns a pointer's checkpoint as Lightning's dict of full CPU tensors.
"""

from shardkeeper.lightning.hook import connect, disconnect, install, installed, uninstall
from shardkeeper.lightning.importer import import_lightning_checkpoint
from shardkeeper.lightning.loading import load_checkpoint
from shardkeeper.lightning.plugin import ShardkeeperCheckpointIO

install()

__all__ = [
    "ShardkeeperCheckpointIO",
    "connect",
    "disconnect",
    "import_lightning_checkpoint",
    "install",
    "installed",
    "load_checkpoint",
    "uninstall",
]
