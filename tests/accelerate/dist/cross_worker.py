"""One process: a checkpoint ``save_state()`` wrote under DDP (2 ranks) restores elsewhere.

``cross_worker.py OUT`` reads ``OUT/cross`` (written by ddp_worker.py) and ``OUT/cross-0.pt``
(the model's parameters and AdamW state at that save) and restores the checkpoint

- in a Lightning Trainer through ``shardkeeper.lightning.ShardkeeperCheckpointIO``
  (``fit(ckpt_path=<root>)``; the LightningModule's FQNs are the model's), and
- into a DeepSpeed ZeRO-2 engine through the DeepSpeed adapter
  (``CheckpointManager.restore(engine_state(engine), only=["model/*", "optim/*"])``),

comparing parameters and optimizer state bit for bit. Writes its checks to ``OUT/cross.json``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.checks import Checks, state_of

OUT = sys.argv[1]
ROOT = os.path.join(OUT, "cross")
checks = Checks()
warnings.filterwarnings("ignore")


def make_model() -> nn.Module:  # as in ddp_worker.py
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))


def expected() -> dict:
    """Rank 0's parameters and optimizer state at the save, by FQN (``tests.checks.state_of``)."""
    return torch.load(os.path.join(OUT, "cross-0.pt"))


def lightning() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from shardkeeper.lightning import ShardkeeperCheckpointIO

    class Net(L.LightningModule):
        """The model's layers as direct children: FQNs ``0.weight``, ... as Accelerate saved."""

        def __init__(self) -> None:
            super().__init__()
            for i, layer in enumerate(make_model()):
                self.add_module(str(i), layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.children():
                x = layer(x)
            return x

        def training_step(self, batch, _):
            x, y = batch
            return ((self(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    got: dict = {}

    class Grab(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            got["global_step"] = trainer.global_step
            got.update(state_of(pl_module, trainer.optimizers[0]))

    from shardkeeper.core import CheckpointManager

    with CheckpointManager(ROOT) as mgr:
        step = mgr.latest_step()
    assert step is not None
    torch.manual_seed(7)  # other initial values: the restore must matter
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    # the Trainer continues the checkpoint's step count: one more step
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=step + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Grab()],
                        plugins=[ShardkeeperCheckpointIO(ROOT, restore_rng=False)])  # rng: 2 ranks saved, 1 here
    trainer.fit(Net(), data, ckpt_path=ROOT)
    want = expected()
    checks.same("lightning_restores_ddp_checkpoint", {k: v for k, v in got.items() if k != "global_step"}, want)
    checks.check("lightning_continues_the_step_count", got.get("global_step") == step and trainer.global_step == step + 1,
                 f"resumed at global_step {got.get('global_step')}, ended at {trainer.global_step}; checkpoint step {step}")


def deepspeed_engine() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from shardkeeper.core import CheckpointManager
    from shardkeeper.deepspeed import engine_state  # tests may; adapters go through load_adapter

    torch.manual_seed(8)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    with CheckpointManager(ROOT) as mgr:
        mgr.restore(engine_state(engine), only=["model/*", "optim/*"])
    got = {}
    for n, p in engine.module.named_parameters():
        got[f"param/{n}"] = safe_get_full_fp32_param(p)
        for m in ("exp_avg", "exp_avg_sq"):
            got[f"optim/{n}/{m}"] = safe_get_full_optimizer_state(p, m)
    want = {k: v for k, v in expected().items() if k.startswith("param/") or k.endswith(("/exp_avg", "/exp_avg_sq"))}
    checks.same("deepspeed_engine_restores_ddp_checkpoint", got, want)  # the fp32 masters and Adam moments


if __name__ == "__main__":
    for fn in (lightning, deepspeed_engine):
        checks.guard(fn.__name__, fn)
    checks.write(os.path.join(OUT, "cross.json"))
