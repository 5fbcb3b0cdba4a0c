"""A ddp fit interrupted mid-epoch at one world size and resumed at another (torchrun, gloo).

    data_worker.py first OUT   # 2 ranks: saves step 3 of the 6-step epoch, trains on to step 5, ends
    data_worker.py second OUT  # any world size: fit(ckpt_path=root) to the end of epoch 1

The train DataLoader is a plain shuffled one (``shuffle=True``): Lightning puts its sampler
in (``use_distributed_sampler``), so the plugin's is used without any change to this code.
The dataset returns each sample's index; every rank records, per optimizer step, the indices of
its batch (``OUT/<phase>-ids-r<rank>.json``: ``[[epoch, step, [ids]], ...]``, the step counted
after the batch). ``first`` writes the parameters and optimizer state after step 3 (the
committed save) to ``OUT/saved-r<rank>.pt``; ``second`` compares them bit for bit with what it
restored, at the start of training (``OUT/second-checks.json``, rank 0's
``tests.checks.Checks``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tests.checks import Checks
from tests.lightning.common import Net
from torch.utils.data import DataLoader, Dataset

from shardkeeper.lightning import ShardkeeperCheckpointIO

N, BATCH, SEED, SAVED_STEP = 48, 4, 7, 3


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """``N`` samples ``(x, y, index)``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class IdNet(Net):
    """``Net`` that records the indices of each batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.append([self.current_epoch, self.trainer.global_step + 1, [int(i) for i in idx]])
        return F.mse_loss(self.model(x), y)


def state(lm: L.LightningModule) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in lm.state_dict().items()}
    osd = lm.trainer.optimizers[0].state_dict()
    for pid, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{pid}/{name}"] = v.clone()
    return out


class Snapshot(Callback):
    """``first``: the state after the saved step; ``second``: compared with it at the start."""

    def __init__(self, out: str, phase: str, checks: Checks) -> None:
        self.out, self.phase, self.checks = out, phase, checks

    def on_train_batch_end(self, trainer: L.Trainer, lm: L.LightningModule, *args: Any) -> None:
        if self.phase == "first" and trainer.global_step == SAVED_STEP:
            torch.save(state(lm), os.path.join(self.out, f"saved-r{trainer.global_rank}.pt"))

    def on_train_start(self, trainer: L.Trainer, lm: L.LightningModule) -> None:
        if self.phase == "second":
            saved = torch.load(os.path.join(self.out, "saved-r0.pt"))
            self.checks.same("parameters and optimizer state restored bit for bit", state(lm), saved)
            self.checks.check("resumed at the saved step", trainer.global_step == SAVED_STEP, trainer.global_step)


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    world = int(os.environ["WORLD_SIZE"])
    checks = Checks()
    L.seed_everything(SEED)
    plugin = ShardkeeperCheckpointIO(os.path.join(out, "root"))
    callbacks: list[Callback] = [Snapshot(out, phase, checks)]
    if phase == "first":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=SAVED_STEP))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        plugins=[plugin],
        max_epochs=2,
        max_steps=5 if phase == "first" else -1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
    )
    net = IdNet()
    loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True)
    trainer.fit(net, loader, ckpt_path=plugin.root if phase == "second" else None)
    with open(os.path.join(out, f"{phase}-ids-r{trainer.global_rank}.json"), "w") as f:
        json.dump(net.seen, f)
    if trainer.global_rank == 0 and phase == "second":
        checks.write(os.path.join(out, "second-checks.json"))


if __name__ == "__main__":
    main()
