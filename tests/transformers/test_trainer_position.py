"""The Trainer's data position at another world size: a 2-rank DDP Trainer killed mid-epoch
after a committed save and resumed by one process sees every sample of the epoch exactly once,
then the next epoch in the order an uninterrupted one-process run uses; the parameters and
AdamW state resume bit for bit (tests/transformers/dist/position_worker.py). The same position
resumes under another framework: an Accelerate loop on one process finishes that epoch, every
sample once. A sampler of the user's own keeps the Trainer's batch skip, with a warning."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checks import assert_same_state
from tests.launch import run_script

pytest.importorskip("shardkeeper.transformers")

WORKER = Path(__file__).parent / "dist" / "position_worker.py"
ENV = {"HF_HUB_OFFLINE": "1"}


def _records(out: Path, mode: str, world: int) -> list[dict[str, Any]]:
    return [json.loads(line) for r in range(world) for line in (out / f"{mode}-r{r}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank run, killed after step 4 with step 2 committed (its folder, to copy)."""
    out = tmp_path_factory.mktemp("killed")
    first = run_script(2, WORKER, "first", str(out), timeout_s=120, env=ENV)
    assert first.returncode != 0, "the first run was meant to kill itself:\n" + first.stdout[-4000:]
    return out


@pytest.mark.multiprocess  # launches processes: run one after another (noxfile)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch", [2, 3], ids=["skipped-batches", "sampler-rest"])
def test_two_ranks_killed_mid_epoch_one_resumes_every_sample_once(killed: Path, tmp_path: Path, batch: int) -> None:
    """8 samples consumed at 2 ranks: one process with batches of 2 skips 4 of them as the
    Trainer skips batches; with batches of 3 the sampler yields the rest from its position."""
    from tests.transformers.dist.position_worker import SAVED, SEED, N, Numbered

    tmp_path = tmp_path / "out"
    shutil.copytree(killed, tmp_path)
    resume = run_script(1, WORKER, "resume", str(tmp_path), str(batch), timeout_s=120, env=ENV)
    assert resume.returncode == 0, resume.stdout[-6000:]
    assert (tmp_path / "resumed-step").read_text() == str(SAVED)
    before = _records(tmp_path, "first", 2)
    assert max(r["step"] for r in before) > SAVED, "the first run trained no step past its last save"
    after = _records(tmp_path, "resume", 1)
    epoch0 = [i for r in before if r["step"] <= SAVED for i in r["ids"]]
    epoch0 += [i for r in after if r["epoch"] == 0 for i in r["ids"]]
    assert Counter(epoch0) == Counter(range(N)), sorted(epoch0)
    ref: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(Numbered(), 1, 0, seed=SEED)
    ref.set_epoch(1)
    assert [i for r in after if r["epoch"] == 1 for i in r["ids"]] == list(ref)
    assert_same_state(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "saved.pt"), what="resumed state")


@pytest.mark.multiprocess  # the 2-rank run it resumes launches processes
@pytest.mark.timeout(240)
def test_a_resume_with_more_accumulation_trains_every_sample_of_both_epochs(killed: Path, tmp_path: Path) -> None:
    """The 8 consumed samples are 4 batches of 2 at one process, no whole step of 3 of them: the
    Trainer's skip would leave the resumed epoch a partial first step and one step too many, so
    the run would reach ``max_steps`` with the last batch untrained. Every sample of the epoch
    once, then the whole next epoch."""
    from tests.transformers.dist.position_worker import SEED, N, Numbered

    tmp_path = tmp_path / "out"
    shutil.copytree(killed, tmp_path)
    resume = run_script(1, WORKER, "resume", str(tmp_path), "2", "3", timeout_s=120, env=ENV)
    assert resume.returncode == 0, resume.stdout[-6000:]
    before = [i for r in _records(tmp_path, "first", 2) if r["step"] <= 2 for i in r["ids"]]
    after = _records(tmp_path, "resume", 1)
    assert Counter(before + [i for r in after if r["epoch"] == 0 for i in r["ids"]]) == Counter(range(N))
    ref: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(Numbered(), 1, 0, seed=SEED)
    ref.set_epoch(1)
    assert [i for r in after if r["epoch"] == 1 for i in r["ids"]] == list(ref)


@pytest.mark.multiprocess  # the 2-rank run it resumes launches processes
@pytest.mark.timeout(240)
def test_a_resume_whose_max_steps_cuts_the_data_warns(killed: Path, tmp_path: Path) -> None:
    """Resumed with batches of 8 (a global batch twice the saved one), the 2 epochs at one
    process are 8 steps, but global_step resumes at 2 (8 samples, one step of 8): the rest
    needs 3 + 4 steps, one more than max_steps, so the last batch is never trained. The
    resume says so, with the step, the rank and the remedy."""
    tmp_path = tmp_path / "out"
    shutil.copytree(killed, tmp_path)
    resume = run_script(1, WORKER, "resume", str(tmp_path), "8", timeout_s=120, env=ENV)
    assert resume.returncode == 0, resume.stdout[-6000:]
    text = " ".join(resume.stdout.split())
    assert "reaches max_steps 8 at step 8 (rank 0)" in text, resume.stdout[-6000:]
    assert "1 optimizer step(s) of data untrained" in text and "max_steps" in text


@pytest.mark.multiprocess  # the 2-rank run it resumes launches processes
@pytest.mark.timeout(240)
def test_accelerate_resumes_the_trainers_position_mid_epoch_every_sample_once(killed: Path, tmp_path: Path) -> None:
    """The position the 2-rank Trainer saved at step 2 (8 of 32 samples, ``extra/data_position/0``)
    resumes in an Accelerate loop on one process (``load_state`` through its adapter; a shuffled
    DataLoader with Accelerate's seedable sampler at the Trainer's seed, batches of 3, so the
    consumed samples are no whole number of its batches): the rest of the epoch is the rest of
    the Trainer's order, each sample of the epoch once; the next epoch is the one the Trainer
    would have drawn at one process."""
    ska = pytest.importorskip("shardkeeper.accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    from tests.transformers.common import tiny_model
    from tests.transformers.dist.position_worker import SAVED, SEED, N, Numbered

    root = tmp_path / "run"
    shutil.copytree(killed / "run", root)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=SEED))
    loader = torch.utils.data.DataLoader(Numbered(), batch_size=3, shuffle=True)
    model, loader = acc.prepare(tiny_model(), loader)
    ska.enable(acc, str(root))
    try:
        assert acc.load_state() == SAVED
        epochs = [[int(i) for batch in loader for i in batch["input_ids"][:, 0]] for _ in range(2)]
    finally:
        ska.disable(acc)
        AcceleratorState._reset_state()
    before = [i for r in _records(killed, "first", 2) if r["step"] <= SAVED for i in r["ids"]]
    assert len(before) == 8 and Counter(before + epochs[0]) == Counter(range(N)), (before, epochs[0])
    ref: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(Numbered(), 1, 0, seed=SEED)
    ref.set_epoch(1)
    assert epochs[1] == list(ref)


class _OwnSampler(torch.utils.data.SequentialSampler):
    """A sampler of the user's own."""


def test_a_sampler_of_the_users_own_keeps_the_trainers_skip_with_a_warning(tmp_path: Path) -> None:
    from tests.transformers.common import Recording, make_trainer

    class Own(Recording):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return _OwnSampler(self.train_dataset if train_dataset is None else train_dataset)  # type: ignore[arg-type]

    trainer = make_trainer(tmp_path / "run", cls=Own, max_steps=1)
    with pytest.warns(UserWarning, match=r"sampler is _OwnSampler \(Own\._get_train_sampler builds it\).* exact at"):
        trainer.train()
    batches: Any = trainer.get_train_dataloader().batch_sampler  # one process: not sharded
    assert isinstance(batches.sampler, _OwnSampler)
