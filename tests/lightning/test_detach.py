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


def test_a_save_below_the_newest_committed_step_is_refused_and_a_resume_continues(tmp_path: Path) -> None:
    """A fresh run into a root whose newest step is 5 cannot commit step 2 (a resume from the
    root would go back to 5); resumed from the root, the Trainer continues at global_step 5."""
    import lightning as L
    import pytest

    from shardkeeper.core import CheckpointManager, StepOrderError
    from tests.lightning.common import Net, loader

    root = tmp_path / "root"

    def trainer(steps: int) -> L.Trainer:
        return L.Trainer(
            default_root_dir=str(tmp_path),
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            plugins=[skl.ShardkeeperCheckpointIO(root, async_save=False)],
        )

    first = trainer(5)
    first.fit(Net(), loader())
    first.save_checkpoint(str(tmp_path / "five.ckpt"))
    fresh = trainer(2)
    fresh.fit(Net(), loader())
    with pytest.raises(
        StepOrderError,
        match=r"global_step 2 .* step 2 is below the newest committed step 5 under "
        r".*root \(rank 0\).*ckpt_path=<the root>",
    ):
        fresh.save_checkpoint(str(tmp_path / "two.ckpt"))
    resumed = trainer(7)
    resumed.fit(Net(), loader(), ckpt_path=str(root))
    assert resumed.global_step == 7
    resumed.save_checkpoint(str(tmp_path / "seven.ckpt"))
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [5, 7]
        assert mgr.manifest(7).metadata["framework"] == "lightning"
