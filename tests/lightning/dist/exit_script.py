"""A user's Lightning script: fit, then trainer.save_checkpoint() outside fit, and end without
waiting (the save is asynchronous).

    exit_script.py ROOT WIDTH      # writes ROOT.ref.safetensors: the module as saved
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from shardkeeper.lightning import ShardkeeperCheckpointIO


class Net(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    root, width = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(width)
    data = DataLoader(TensorDataset(torch.randn(8, width), torch.randn(8, 4)), batch_size=4)
    plugin = ShardkeeperCheckpointIO(root)
    trainer = L.Trainer(default_root_dir=os.path.dirname(root), max_epochs=1, accelerator="cpu", devices=1,
                        plugins=[plugin], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    net = Net(width)
    trainer.fit(net, data)
    # the reference first: anything slow after the save would give it time to finish before the exit
    save_file({k: v.detach().clone() for k, v in net.model.state_dict().items()}, root + ".ref.safetensors")
    trainer.save_checkpoint(root + ".last.ckpt")  # a pointer file there; the step goes under the root
    print('RESULT {"saved": true}', flush=True)


if __name__ == "__main__":
    main()
