"""Train a tiny HNet on 2 gloo ranks with the plugin, under ddp and ModelParallel (FSDP2,
dp=2), and write the full state it saved (parameters and AdamW moments by FQN) for the
single-process inference test. Rank 1 also loads each run alone while the group is up
(the load is not a collective).

    save_for_inference.py DIR    # DIR/<strategy>/{root,ckpts,ref.safetensors}
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import save_file

from shardkeeper.lightning import ShardkeeperCheckpointIO, load_checkpoint
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
        if t.global_rank == 1:  # one rank alone, inside the live process group: the load is no collective
            got = load_checkpoint(f"{out}/ckpts/last.ckpt")["state_dict"]
            bad = [k for k, v in got.items() if not torch.equal(v, state[f"model/{k}"])]
            if bad or len(got) != sum(k.startswith("model/") for k in state):
                raise SystemExit(f"{name}: rank 1's lone load differs from the run's state: {bad}")
        torch.distributed.barrier()
    print('RESULT {"saved": true}', flush=True)


if __name__ == "__main__":
    main()
