"""A Trainer checkpoint restores in the other frameworks, each continuing its step count:
plain torch (``CheckpointManager.restore``), Accelerate (``load_state``) and Lightning
(``fit(ckpt_path=root)``), one process each, bit for bit. The other direction (an Accelerate
run resumed by the Trainer) is a hop of tests/chain. The adapters are found as installed
distributions; this adapter imports none of them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("shardkeeper.transformers")

from shardkeeper.core import CheckpointManager  # noqa: E402
from tests.checks import state_diff, state_of  # noqa: E402
from tests.transformers.common import STEPS, Tokens, tiny_model  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


def _adamw(trainer: Any, model: torch.nn.Module, **kwargs: Any) -> torch.optim.AdamW:
    """An AdamW over ``model`` with the Trainer's two param groups (decay, no decay), other
    hyperparameters than the Trainer's: the restore must bring the saved ones back."""
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay]},
        {"params": [p for n, p in model.named_parameters() if n not in decay]},
    ]
    return torch.optim.AdamW(groups, lr=0.5, **kwargs)


def test_plain_torch_restores_the_trainers_checkpoint(reference: tuple[Path, Any]) -> None:
    root, trainer = reference
    model = tiny_model()
    optim = _adamw(trainer, model, weight_decay=0.3)
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": model, "optim": optim}) == STEPS
    assert not state_diff(state_of(model, optim), state_of(trainer.model, trainer.optimizer.optimizer))


def test_accelerate_restores_the_trainers_checkpoint(reference: tuple[Path, Any]) -> None:
    """The Accelerate adapter's load_state takes the Trainer's step: model and AdamW bit-exact,
    the step count on."""
    ska = pytest.importorskip("shardkeeper.accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    root, trainer = reference
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    model = tiny_model()
    model, optim = acc.prepare(model, _adamw(trainer, model))
    ska.enable(acc, str(root))
    try:
        assert acc.load_state() == STEPS
        assert acc.project_configuration.iteration == STEPS + 1  # its next save continues the step count
        want = state_of(trainer.model, trainer.optimizer.optimizer)
        assert not state_diff(state_of(acc.unwrap_model(model), optim.optimizer), want)
    finally:
        ska.disable(acc)
        AcceleratorState._reset_state()


def test_lightning_resumes_the_trainers_checkpoint(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    """``fit(ckpt_path=root)`` in a Lightning Trainer through the Lightning adapter: at its start
    the module and AdamW equal the Transformers Trainer's at step 12 (the RNG comes back too),
    it trains step 13, and its save commits step 13 in the same root."""
    pytest.importorskip("shardkeeper.lightning")
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from shardkeeper.lightning import ShardkeeperCheckpointIO

    root, trainer = reference
    copy = tmp_path / "run"  # the reference root stays as the other tests expect it
    shutil.copytree(root, copy)
    hf_trainer = trainer

    class Module(L.LightningModule):
        """The GPT-2's own children as this module's: the FQNs the Trainer saved."""

        def __init__(self) -> None:
            super().__init__()
            gpt = tiny_model()
            for name, child in gpt.named_children():
                self.add_module(name, child)
            object.__setattr__(self, "gpt", gpt)  # its forward, outside the module tree

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            return self.gpt(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _adamw(hf_trainer, self.gpt)

    got: dict[str, Any] = {}

    class Grab(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            got["global_step"] = trainer.global_step
            got["state"] = state_of(pl_module, trainer.optimizers[0])

    torch.manual_seed(99)  # another RNG state than the checkpoint's
    plugin = ShardkeeperCheckpointIO(str(copy))
    lt = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Grab()],
        plugins=[plugin],
    )
    data = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    module = Module()
    lt.fit(module, data, ckpt_path=str(copy))
    assert got["global_step"] == STEPS and lt.global_step == STEPS + 1
    assert not state_diff(got["state"], state_of(trainer.model, trainer.optimizer.optimizer))
    lt.save_checkpoint(str(tmp_path / "after.ckpt"))  # a pointer file; the state goes to the root
    plugin.wait()
    with CheckpointManager(copy) as mgr:
        assert mgr.latest_step() == STEPS + 1
        assert mgr.manifest(STEPS + 1).metadata["framework"] == "lightning"
