"""``ShardkeeperCheckpointIO``: the Trainer plugin.

Once the Trainer hands the plugin to its strategy (``strategy.checkpoint_io = plugin``), the
hook (:mod:`shardkeeper.lightning.hook`) connects them: the strategy's ``save_checkpoint``,
``load_checkpoint`` and ``remove_checkpoint`` then go, on every rank, to the plugin's
``binding`` (:mod:`shardkeeper.lightning.binding`), which does the saving and restoring.
"""

from __future__ import annotations

import os
from typing import Any, cast

from lightning.fabric.plugins import CheckpointIO
from shardkeeper.core import CheckpointManager
from shardkeeper.lightning.binding import StrategyBinding
from shardkeeper.lightning.installation import installed


class ShardkeeperCheckpointIO(CheckpointIO):
    """Checkpoints of every rank's state under ``root`` (a path, ``s3://...``, ``gs://...``).

    ``Trainer(plugins=[ShardkeeperCheckpointIO(root, **options)])``; ``options`` go to
    :class:`shardkeeper.core.CheckpointManager` (``keep_last``, ``keep_every``,
    ``storage_options``, ``metadata``, ``async_save``, ``per_rank``, ...).
    ``restore_rng``: restore each rank's RNG state on resume (default True).
    """

    def __init__(self, root: str | os.PathLike[str], *, restore_rng: bool = True, **manager_options: Any) -> None:
        super().__init__()
        if not installed():
            raise RuntimeError(
                "shardkeeper.lightning.uninstall() was called, so a Trainer would never connect this "
                "plugin to its strategy; call shardkeeper.lightning.install() before building the Trainer"
            )
        s = os.fspath(root)
        self.root = s if "://" in s else os.path.abspath(s)
        self.restore_rng = restore_rng
        self.manager_options = manager_options
        self.strategy: Any = None  # the strategy the hook connected this plugin to
        self.binding = StrategyBinding(self)  # what that strategy's checkpoint methods call

    # -- CheckpointIO --------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if self.strategy is None:
            raise RuntimeError(_NOT_CONNECTED)
        self.strategy.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self.strategy is None:
            raise RuntimeError(_NOT_CONNECTED)
        return cast("dict[str, Any]", self.strategy.load_checkpoint(path))

    def remove_checkpoint(self, path: Any) -> None:
        if self.binding.foreign_removal:  # the strategy's own removal of a file that is not our pointer
            from lightning.fabric.plugins import TorchCheckpointIO

            TorchCheckpointIO().remove_checkpoint(path)
            return
        if self.strategy is None:
            raise RuntimeError(_NOT_CONNECTED)
        self.strategy.remove_checkpoint(path)  # every rank: a step deletion is collective

    def teardown(self) -> None:
        self.wait()

    # -- public helpers ------------------------------------------------------------------------
    def step_path(self, step: int) -> str:
        """A ``ckpt_path`` naming ``step`` under this plugin's root."""
        return f"{self.root}/step-{step:012d}"

    def steps(self) -> list[int]:
        """Committed steps under the root."""
        return self.manager().steps()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and its paths point at it;
        raise its failure (its paths then keep what they named). A failure to write a pointer
        is logged here (rank 0 alone must not raise), and raised by the next save."""
        self.binding.wait()

    def close(self) -> None:
        self.binding.close()

    def manager(self) -> CheckpointManager:
        """The manager of the root (created on first use: a collective on every rank)."""
        return self.binding.manager()


_NOT_CONNECTED = (
    "ShardkeeperCheckpointIO is not connected to a strategy (shardkeeper.lightning.disconnect() was called, "
    "or the plugin was never handed to a Trainer): pass it to the Trainer "
    "(Trainer(plugins=[ShardkeeperCheckpointIO(root)])) and import shardkeeper.lightning "
    "before the Trainer is built"
)

__all__ = ["ShardkeeperCheckpointIO"]
