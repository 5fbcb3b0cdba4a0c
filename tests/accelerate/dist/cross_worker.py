"""One process: a checkpoint ``save_state()`` wrote under DDP (2 ranks) restores elsewhere.

``cross_worker.py OUT`` reads ``OUT/cross`` (written by ddp_worker.py) and ``OUT/cross-0.pt``
(the model's parameters and AdamW state at that save) and restores the checkpoint

- in a Lightning Trainer through ``shardkeeper.lightning.ShardkeeperCheckpointIO``
  (``fit(ckpt_path=<root>)``; the LightningModule's FQNs are the model's), and
- into a DeepSpeed ZeRO-2 engine through the DeepSpeed adapter
  (``CheckpointManager.restore(engine_state(engine), only=["model/*", "optim/*"])``),

comparing parameters and optimizer state bit for bit. Writes ``OUT/cross.json``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUT = sys.argv[1]
ROOT = os.path.join(OUT, "cross")
checks: dict[str, object] = {}
warnings.filterwarnings("ignore")


def check(name: str, ok: bool, detail: str = "") -> None:
    checks[name] = True if ok else (detail or "failed")


def make_model() -> nn.Module:  # as in ddp_worker.py
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))


NAMES = [n for n, _ in make_model().named_parameters()]


def expected() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    snap = torch.load(os.path.join(OUT, "cross-0.pt"))
    return snap["params"], {NAMES[i]: s for i, s in snap["opt"].items()}


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
            opt = trainer.optimizers[0]
            got["global_step"] = trainer.global_step
            got["params"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            got["opt"] = {NAMES[i]: {k: v.clone() for k, v in opt.state[p].items()}
                          for i, p in enumerate(pl_module.parameters()) if p in opt.state}

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
    params, opt = expected()
    bad = [k for k in params if not torch.equal(params[k], got["params"].get(k, torch.empty(0)))]
    bad += [f"{n}/{k}" for n in opt for k in opt[n] if not torch.equal(opt[n][k], got["opt"].get(n, {}).get(k, torch.empty(0)))]
    check("lightning_restores_ddp_checkpoint", not bad and set(got["opt"]) == set(opt), f"differ: {bad}")
    check("lightning_continues_the_step_count", got.get("global_step") == step and trainer.global_step == step + 1,
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
    params, moments = expected()
    bad = []
    for n, p in engine.module.named_parameters():
        if not torch.equal(safe_get_full_fp32_param(p), params[n]):
            bad.append(n)
        for m in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(safe_get_full_optimizer_state(p, m), moments[n][m]):
                bad.append(f"{n}/{m}")
    check("deepspeed_engine_restores_ddp_checkpoint", not bad, f"differ: {bad}")


if __name__ == "__main__":
    for fn in (lightning, deepspeed_engine):
        try:
            fn()
        except Exception:
            checks[fn.__name__] = traceback.format_exc()
    with open(os.path.join(OUT, "cross.json"), "w") as f:
        json.dump(checks, f, indent=1)
