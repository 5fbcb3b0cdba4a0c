"""The Lightning adapter under the core's adapter contract: it can be detached (``uninstall()``
gives ``Strategy.checkpoint_io`` its own setter back, ``disconnect(plugin)`` gives a connected
strategy its own methods back), it keeps the step rule, and its retention deletes only steps
the Lightning plugin wrote."""

from __future__ import annotations

from pathlib import Path

import torch
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
    "on_train_start",
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
    assert type(strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # the strategy saves natively again
    skl.uninstall()
    try:
        assert not skl.installed() and vars(Strategy)["checkpoint_io"] is not patched
        import pytest

        with pytest.raises(RuntimeError, match=r"uninstall\(\) was called.*call shardkeeper.lightning.install\(\)"):
            skl.ShardkeeperCheckpointIO(tmp_path / "root")  # a Trainer would never connect it: fail now
    finally:
        skl.install()
    assert skl.installed()


def test_a_save_below_the_newest_committed_step_is_refused_and_a_resume_continues(tmp_path: Path) -> None:
    """A run at step 2 cannot commit step 2 into a root whose newest step became 5 meanwhile
    (a resume from the root would go back to 5); resumed from the root, the Trainer continues
    at global_step 5."""
    import pytest

    from shardkeeper.core import CheckpointManager, StepOrderError
    from tests.lightning.common import Net, loader

    root = tmp_path / "root"

    fresh = _trainer(tmp_path, root, 2)
    fresh.fit(Net(), loader())
    first = _trainer(tmp_path, root, 5)
    first.fit(Net(), loader())
    first.save_checkpoint(str(tmp_path / "five.ckpt"))
    with pytest.raises(
        StepOrderError,
        match=r"global_step 2 .* step 2 is below the newest committed step 5 under "
        r".*root \(rank 0\).*ckpt_path=<the root>",
    ):
        fresh.save_checkpoint(str(tmp_path / "two.ckpt"))
    resumed = _trainer(tmp_path, root, 7)
    resumed.fit(Net(), loader(), ckpt_path=str(root))
    assert resumed.global_step == 7
    resumed.save_checkpoint(str(tmp_path / "seven.ckpt"))
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [5, 7]
        assert mgr.manifest(7).metadata["framework"] == "lightning"


def _trainer(tmp_path: Path, root: Path, steps: int, **kw: object):
    import lightning as L

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
        **kw,
    )


def _core_save(root: Path, step: int) -> None:
    from shardkeeper.core import CheckpointManager
    from tests.lightning.common import Net

    net = Net()
    opt = net.configure_optimizers()["optimizer"]
    net.model(torch.randn(2, 8)).sum().backward()
    opt.step()  # Adam state exists: a full checkpoint, as another framework writes one
    with CheckpointManager(str(root)) as mgr:
        mgr.save(step, {"model": net, "optim": opt}, async_save=False)


def test_a_fresh_run_at_a_committed_step_is_refused(tmp_path: Path) -> None:
    """Only the step a run resumed from may be 'saved' again (kept as it is); a run whose save
    lands on another run's committed step would otherwise persist nothing."""
    import pytest

    from shardkeeper.core import CommitConflictError
    from tests.lightning.common import Net, loader

    root = tmp_path / "root"
    fresh = _trainer(tmp_path, root, 2)
    fresh.fit(Net(), loader())
    _core_save(root, 2)  # another writer, while this run trained
    with pytest.raises(CommitConflictError, match=r"step 2 is already committed under .*root \(rank 0\)"):
        fresh.save_checkpoint(str(tmp_path / "two.ckpt"))


def test_retention_never_deletes_a_step_another_framework_wrote(tmp_path: Path) -> None:
    from shardkeeper.core import CheckpointManager
    from tests.lightning.common import Net, loader

    root = tmp_path / "root"
    _core_save(root, 3)
    at3 = _trainer(tmp_path, root, 3)
    at3.fit(Net(), loader(), ckpt_path=str(root))  # resumes at 3, nothing to train
    at3.save_checkpoint(str(tmp_path / "three.ckpt"))  # the step it resumed from: a pointer to it
    t = _trainer(tmp_path, root, 5)
    t.fit(Net(), loader(), ckpt_path=str(root))  # resumes at 3, trains to 5
    t.save_checkpoint(str(tmp_path / "five.ckpt"))
    t.strategy.remove_checkpoint(str(tmp_path / "three.ckpt"))  # ModelCheckpoint's top-k drops it
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [3, 5]  # step 3 is the core's: not the plugin's to delete
    t.save_checkpoint(str(tmp_path / "five-again.ckpt"))
    t.strategy.remove_checkpoint(str(tmp_path / "five.ckpt"))
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [3, 5]  # still named by five-again.ckpt


def test_a_fresh_fit_on_a_used_root_is_refused_before_training(tmp_path: Path) -> None:
    """A fresh fit() on a root holding step 5 would train to its first save and die there:
    it is refused before its first training step, naming the root, the newest step and the
    remedies. A resumed fit, a second fit() of that Trainer and a root holding only a torn
    step go ahead."""
    import pytest

    from shardkeeper.core import CheckpointManager, StartRefusedError
    from tests.lightning.common import Net, loader

    root = tmp_path / "root"
    first = _trainer(tmp_path, root, 5)
    first.fit(Net(), loader())
    first.save_checkpoint(str(tmp_path / "five.ckpt"))
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fresh = _trainer(tmp_path, root, 8)
    with pytest.raises(StartRefusedError) as refused:
        fresh.fit(net, loader())
    msg = str(refused.value)
    assert f"{root} already holds committed step 5 (rank 0); this run starts from step 0" in msg
    assert f"ckpt_path={str(root)!r}" in msg and "ckpt_path='last'" in msg
    assert "another root" in msg and "start over with this root emptied" in msg
    assert fresh.global_step == 0 and net.losses == {}
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())

    resumed = _trainer(tmp_path, root, 7)
    model = Net()
    resumed.fit(model, loader(), ckpt_path=str(root))
    resumed.save_checkpoint(str(tmp_path / "seven.ckpt"))
    resumed.fit_loop.epoch_loop.max_steps = 9  # a second fit() continues this run's steps
    resumed.fit(model, loader())
    resumed.save_checkpoint(str(tmp_path / "nine.ckpt"))
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [5, 7, 9]

    torn = tmp_path / "torn"
    (torn / "step-000000000005" / "data").mkdir(parents=True)  # a crash's leftovers: no manifest
    again = _trainer(tmp_path, torn, 2)
    again.fit(Net(), loader())
    assert again.global_step == 2
