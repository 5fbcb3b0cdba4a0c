"""Train a tiny HNet on 2 gloo ranks with the plugin, under ddp and ModelParallel (FSDP2,
dp=2), and write the full state it saved (parameters and AdamW moments by FQN) for the
single-process inference test.

    save_for_inference.py DIR    # DIR/<strategy>/{root,ckpts,ref.safetensors}
"""

from __future__ import annotations

import os
import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import save_file

from shardkeeper.lightning import ShardkeeperCheckpointIO
from tests.lightning.common import HNet, full_state, loader


def main() -> None:
    d = sys.argv[1]
    world = int(os.environ["WORLD_SIZE"])
    for name in ("ddp", "fsdp2"):
        L.seed_everything(11)
        out = f"{d}/{name}"
        strategy = "ddp" if name == "ddp" else ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        t = L.Trainer(
            max_epochs=1, accelerator="cpu", devices=world, strategy=strategy, logger=False,
            plugins=[ShardkeeperCheckpointIO(f"{out}/root")], enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=f"{out}/ckpts", save_last=True)], deterministic=True,
        )
        net = HNet(mode="none" if name == "ddp" else "fsdp2", lr=0.03, tag=name)
        t.fit(net, loader())
        state = full_state(net, t.optimizers[0])  # a collective under FSDP2
        if t.global_rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/ref.safetensors")
    print('RESULT {"saved": true}', flush=True)


if __name__ == "__main__":
    main()
