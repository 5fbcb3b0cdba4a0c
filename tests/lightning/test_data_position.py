"""The train data's position under the plugin: a ddp fit saved mid-epoch at 2 ranks resumes at
3 (torchrun, gloo), and over the epoch every sample is seen exactly once.

``dist/data_worker.py first`` (2 ranks) saves step 3 of a 6-step epoch and trains on to step 5
(lost work); ``second`` (3 ranks) resumes from the root. The indices trained on in the epoch
(steps 1-3 of the first run, the rest of the epoch in the second) are the dataset, each once;
the next epoch is the one ``DistributedSampler`` yields at 3 ranks; parameters and optimizer
state come back bit for bit. The single-process tests show what a sampler of the user's own
gets: nothing is replaced or recorded.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import lightning as L
import pytest
import torch.distributed
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from shardkeeper.core import CheckpointManager, ResumableDistributedSampler
from shardkeeper.lightning import ShardkeeperCheckpointIO
from shardkeeper.lightning.data import LightningSampler
from tests.checks import assert_checks, read_checks
from tests.launch import run_script
from tests.lightning.common import BATCH, N_SAMPLES, Net, cpu_trainer, loader

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "data_worker.py"


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """A ddp fit in this process (``_ddp_one``) sets MASTER_PORT and the like in its
    environment and binds that port: restore both, or every later launch of the session
    inherits a port this process holds (EADDRINUSE)."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


N, SEED, SAVED_STEP = 48, 7, 3


def _ids(out: Path, phase: str, world: int) -> list[list[list[Any]]]:
    return [json.loads((out / f"{phase}-ids-r{r}.json").read_text()) for r in range(world)]


# Two launches (2 then 3 ranks), each about 22 s on an idle 2-core machine, nearly all of it
# process start (torchrun, then each rank importing torch and Lightning: 8 s alone); the
# training is 11 tiny steps, so less data or fewer steps would not shorten it. With other
# suites running beside it a launch took up to 40 s: each gets 180 s, the test twice that.
@pytest.mark.timeout(420)
def test_a_fit_saved_mid_epoch_at_two_ranks_resumes_at_three_every_sample_once(tmp_path: Path) -> None:
    first = run_script(2, WORKER, "first", str(tmp_path), timeout_s=180)
    assert first.returncode == 0, first.stdout[-4000:]
    assert CheckpointManager(str(tmp_path / "root")).steps() == [SAVED_STEP]
    second = run_script(3, WORKER, "second", str(tmp_path), timeout_s=180)
    assert second.returncode == 0, second.stdout[-4000:]
    assert_checks(
        read_checks(tmp_path / "second-checks.json", output=second.stdout),
        ["parameters and optimizer state restored bit for bit", "resumed at the saved step"],
        where="2 -> 3",
    )
    before = [ids for rank in _ids(tmp_path, "first", 2) for epoch, step, ids in rank if step <= SAVED_STEP]
    after = _ids(tmp_path, "second", 3)
    rest = [ids for rank in after for epoch, step, ids in rank if epoch == 0]
    seen = Counter(i for ids in before + rest for i in ids)
    assert sorted(seen) == list(range(N)), f"skipped: {sorted(set(range(N)) - set(seen))}"
    assert [i for i, c in seen.items() if c > 1] == [], "duplicated"
    # the resumed epoch ends after its last remaining batch: 24 samples left, 8 a rank, 2 steps
    assert [[step for epoch, step, _ in rank if epoch == 0] for rank in after] == [[4, 5]] * 3
    # the next epoch: DistributedSampler's at 3 ranks, all of it (16 samples a rank, 4 steps)
    for r, rank in enumerate(after):
        reference: DistributedSampler[int] = DistributedSampler(cast(Any, range(N)), 3, r, shuffle=True, seed=SEED)
        reference.set_epoch(1)
        assert [i for epoch, _, ids in rank if epoch == 1 for i in ids] == list(reference), r
        assert [step for epoch, step, _ in rank if epoch == 1] == [6, 7, 8, 9]


class _Probe(L.Callback):
    def __init__(self) -> None:
        self.samplers: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dl = trainer.train_dataloader
        assert isinstance(dl, DataLoader)
        self.samplers.append(dl.sampler)


def _ddp_one(tmp_path: Path, *plugins: Any, callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        strategy="ddp",
        plugins=list(plugins),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def test_the_plugin_puts_its_sampler_where_lightning_puts_distributed_sampler(tmp_path: Path) -> None:
    """Lightning's own ``DistributedSampler`` without the plugin; the plugin's, same order, with it."""
    stock, ours = _Probe(), _Probe()
    _ddp_one(tmp_path / "a", callbacks=[stock]).fit(Net(), loader())
    plugin = ShardkeeperCheckpointIO(tmp_path / "root")
    trainer = _ddp_one(tmp_path / "b", plugin, callbacks=[ours])
    trainer.fit(Net(), loader())
    assert type(stock.samplers[0]) is DistributedSampler
    s = ours.samplers[0]
    assert isinstance(s, LightningSampler) and isinstance(s, ResumableDistributedSampler)
    assert len(s) == N_SAMPLES and s.consumed == N_SAMPLES  # advanced by the plugin, batch by batch
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    mgr = CheckpointManager(str(tmp_path / "root"))
    pos = mgr.load(only=["extra/data_position/*"])["extra"]["data_position"]["0"]
    assert pos["consumed"] == N_SAMPLES and pos["epoch"] == 0 and pos["seed"] == 0
    assert list(s) == list(stock.samplers[0])  # the same order (a new pass of epoch 0)


def test_a_sampler_of_the_users_own_is_left_as_it_is_and_not_recorded(tmp_path: Path) -> None:
    """A DistributedSampler (here a ResumableDistributedSampler) the user set: Lightning keeps it,
    so does the plugin; no position is saved for it."""
    ds = loader().dataset
    own = ResumableDistributedSampler(ds, num_replicas=1, rank=0, count="yielded")
    probe = _Probe()
    plugin = ShardkeeperCheckpointIO(tmp_path / "root")
    trainer = _ddp_one(tmp_path, plugin, callbacks=[probe])
    trainer.fit(Net(), DataLoader(ds, batch_size=BATCH, sampler=own))
    assert probe.samplers == [own]
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    leaves = CheckpointManager(str(tmp_path / "root")).manifest(trainer.global_step).leaves
    assert not any(k.startswith(("data/", "extra/data_position/")) for k in leaves)


def test_a_single_device_trainer_keeps_its_random_sampler(tmp_path: Path) -> None:
    """Without a distributed strategy Lightning puts no DistributedSampler in, nor does the plugin."""
    probe = _Probe()
    cpu_trainer(tmp_path, ShardkeeperCheckpointIO(tmp_path / "root"), callbacks=[probe]).fit(Net(), loader())
    assert type(probe.samplers[0]) is RandomSampler
