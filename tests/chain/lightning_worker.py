"""Hop 3: a Lightning Trainer (ddp, CPU, world size 2) with ``ShardkeeperCheckpointIO(root)``
resumes with ``fit(ckpt_path=root)`` (the newest committed step, docs/lightning.md), trains 2
more optimizer steps, and saves with ``trainer.save_checkpoint``.

    lightning_worker.py ROOT OUT
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402
from shardkeeper.lightning import ShardkeeperCheckpointIO  # noqa: E402
from tests.chain.common import Hop, adam, add_layers, batch, committed_steps, forward, record, run_hop  # noqa: E402

STEPS = 2


class LitNet(L.LightningModule):
    """The chain's model (the same FQNs: ``inp.*``, ``out.*``) and Adam."""

    def __init__(self) -> None:
        super().__init__()
        add_layers(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self, x)

    def training_step(self, b, _):
        x, y = b
        return (self(x[0]) - y[0]).pow(2).mean()

    def configure_optimizers(self):
        return adam(self.parameters())


class Batches(Dataset):
    """Item ``i`` is the whole batch of step ``i`` on this rank (``batch_size=1``, no shuffle)."""

    def __init__(self, first_step: int, rank: int) -> None:
        self.first_step, self.rank = first_step, rank

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int):
        return batch(self.first_step + i, self.rank)


def module_record(lm: L.LightningModule, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    params = dict(lm.named_parameters())
    return record(params, {n: opt.state.get(p, {}) for n, p in params.items()})


class Probe(Callback):
    """At the start of training: what was restored and Lightning's step counter. Stops the fit
    after ``STEPS`` optimizer steps, whatever the counters say."""

    def __init__(self) -> None:
        self.at_start: dict = {}
        self.batches = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_start = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "state": module_record(pl_module, trainer.optimizers[0]),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx) -> None:
        self.batches += 1
        if self.batches >= STEPS:
            trainer.should_stop = True


def run(hop: Hop, root: str) -> None:
    torch.manual_seed(100 + hop.index)
    with CheckpointManager(root) as mgr:
        newest = mgr.latest_step()  # what fit(ckpt_path=root) restores
    probe = Probe()
    plugin = ShardkeeperCheckpointIO(root)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
        plugins=[plugin],
        max_epochs=1000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    data = DataLoader(Batches(newest, hop.rank), batch_size=1, shuffle=False)
    trainer.fit(LitNet(), data, ckpt_path=root)
    lm = trainer.lightning_module
    hop.loaded(newest, probe.at_start["state"])
    hop.counter("trainer.global_step", probe.at_start["global_step"], newest)
    hop.check(
        "trained exactly 2 optimizer steps",
        trainer.global_step - probe.at_start["global_step"] == STEPS,
        f"global_step {probe.at_start['global_step']} -> {trainer.global_step}",
    )
    before = committed_steps(root)
    trainer.save_checkpoint(os.path.join(hop.out, "lightning", "after-fit.ckpt"))  # a pointer file; the state: the root
    plugin.wait()
    hop.saved(
        before,
        committed_steps(root),
        newest + STEPS,
        module_record(lm, trainer.optimizers[0]),
        f"trainer.global_step = {trainer.global_step}",
    )


if __name__ == "__main__":
    run_hop("lightning", run)
