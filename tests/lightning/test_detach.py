"""The Lightning adapter can be detached: ``uninstall()`` gives ``Strategy.checkpoint_io`` its
own setter back, ``disconnect(plugin)`` gives a connected strategy its own methods back."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy

import shardkeeper.lightning as skl

PATCHED = (
    "save_checkpoint",
    "load_checkpoint",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "lightning_module_state_dict",
    "optimizer_state",
    "remove_checkpoint",
    "teardown",
)


def test_disconnect_and_uninstall_restore_lightning(tmp_path: Path) -> None:
    assert skl.installed()  # importing shardkeeper.lightning installs the hook
    patched = vars(Strategy)["checkpoint_io"]
    strategy = SingleDeviceStrategy("cpu")
    before = {name: vars(strategy).get(name) for name in PATCHED}
    plugin = skl.ShardkeeperCheckpointIO(tmp_path / "root")
    strategy.checkpoint_io = plugin  # the hook connects the plugin
    assert plugin.strategy is strategy and all(vars(strategy).get(n) is not None for n in PATCHED)
    skl.disconnect(plugin)
    assert {name: vars(strategy).get(name) for name in PATCHED} == before and plugin.strategy is None
    assert not hasattr(strategy, "_shardkeeper_plugin")
    skl.uninstall()
    try:
        assert not skl.installed() and vars(Strategy)["checkpoint_io"] is not patched
        other = SingleDeviceStrategy("cpu")
        other.checkpoint_io = skl.ShardkeeperCheckpointIO(tmp_path / "root")  # a plain CheckpointIO now
        assert "save_checkpoint" not in vars(other)
    finally:
        skl.install()
    assert skl.installed()
