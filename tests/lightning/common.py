"""Models, data and state digests shared by the Lightning tests and their worker scripts."""

from __future__ import annotations

import json
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_SAMPLES = 32
BATCH = 4


class Net(L.LightningModule):
    """A small MLP; ``mode`` says how configure_model() parallelizes it (fsdp2, tp, or none)."""

    def __init__(self, mode: str = "none", lr: float = 0.05) -> None:
        super().__init__()
        self.mode = mode
        self.lr = lr
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        elif self.mode == "tp":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(self.model, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.losses[self.trainer.global_step] = float(loss.detach())
        self.log("train_loss", loss, sync_dist=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = torch.randn(N_SAMPLES, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def full_state(lm: L.LightningModule, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and optimizer state by FQN: a collective under FSDP2/TP."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(lm, options=opts).items()}
    osd = get_optimizer_state_dict(lm, opt, options=opts)
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{fqn}/{name}"] = v.detach().clone().reshape(v.shape)
    return out


def dump(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
