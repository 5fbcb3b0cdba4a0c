"""A real Accelerator(cpu=True) loop saved mid-epoch on gloo ranks (torchrun) resumes at
another world size: over the epoch every sample is seen exactly once.

``dist/data_worker.py first`` calls ``save_state()`` after step 3 and trains on to step 5 (lost
work); ``second`` calls ``load_state()`` at the other world size, finishes the epoch and trains
the next. The indices trained on in the epoch (steps 1-3 of the first run, the rest in the
second) are the dataset, each once; the next epoch is all of it once; parameters and optimizer
state come back bit for bit. 2 -> 1 with a plain shuffled DataLoader (Accelerate's synchronized
generator) and with a sampler of the user's own (a seeded permutation per epoch); 1 -> 2, where
the 3 batches consumed do not divide by the 2 new ranks (the rest is split by samples), with
the user's sampler. Accelerate's seedable sampler is resumed from a Trainer's position in
tests/transformers/test_trainer_position.py.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardkeeper.core import CheckpointManager, ResumableDistributedSampler, StateMismatchError
from tests.checks import assert_checks, read_checks
from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "data_worker.py"
N, SAVED_STEP, BATCH = 48, 3, 4


def _ids(out: Path, phase: str, world: int) -> list[list[list[Any]]]:
    return [json.loads((out / f"{phase}-ids-r{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("worlds", "kind"),
    [((2, 1), "shuffle"), ((2, 1), "own"), ((1, 2), "own")],
    ids=["2to1-shuffle", "2to1-own", "1to2-own"],
)
def test_a_loop_saved_mid_epoch_resumes_at_another_world_size_every_sample_once(
    tmp_path: Path, worlds: tuple[int, int], kind: str
) -> None:
    w1, w2 = worlds
    first = run_script(w1, WORKER, "first", str(tmp_path), kind, timeout_s=90, torchrun=True)
    assert first.returncode == 0, first.stdout[-4000:]
    second = run_script(w2, WORKER, "second", str(tmp_path), kind, timeout_s=90, torchrun=True)
    assert second.returncode == 0, second.stdout[-4000:]
    for r in range(w2):
        assert_checks(
            read_checks(tmp_path / f"second-r{r}.json", output=second.stdout),
            ["restored the saved step", "parameters and optimizer state restored bit for bit"],
            where=f"{w1} -> {w2}, rank {r}",
        )
    before = [ids for rank in _ids(tmp_path, "first", w1) for _, step, ids in rank if step <= SAVED_STEP]
    after = _ids(tmp_path, "second", w2)
    rest = [[ids for p, _, ids in rank if p == 0] for rank in after]
    seen = Counter(i for ids in before + [ids for rank in rest for ids in rank] for i in ids)
    assert sorted(seen) == list(range(N)), f"skipped: {sorted(set(range(N)) - set(seen))}"
    assert [i for i, c in seen.items() if c > 1] == [], "duplicated"
    left = N - SAVED_STEP * BATCH * w1  # split across the new ranks by samples, in batches of 4
    assert [len(r) for r in rest] == [math.ceil(left / w2 / BATCH)] * w2
    assert sorted(i for rank in after for p, _, ids in rank if p == 1 for i in ids) == list(range(N))  # the next epoch


class _Ids(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int = 30) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(2), i


def _accelerate_leg(root: Path, take: int | None, n: int = 30) -> list[int]:
    """One process: ``load_state()``, then the DataLoader's indices (``take`` batches, then
    ``save_state()``; None: to the end of the pass)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    import shardkeeper.accelerate as ska

    AcceleratorState._reset_state()
    acc = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5),
        project_config=ProjectConfiguration(project_dir=str(root)),
    )
    _, dl = acc.prepare(nn.Linear(2, 1), DataLoader(_Ids(n), batch_size=3, shuffle=True))
    ska.enable(acc, str(root), async_save=False)
    seen: list[int] = []
    try:
        acc.load_state()
        for k, (_, idx) in enumerate(dl):
            seen += [int(i) for i in idx]
            if k + 1 == take:
                acc.save_state()
                break
    finally:
        ska.disable(acc)
        AcceleratorState._reset_state()
    return seen


def test_a_plain_loops_position_resumes_and_a_save_in_that_pass_resumes_at_the_same_size(tmp_path: Path) -> None:
    """A plain loop's position (``extra/data_position/0``: 2 ranks took 4 samples each) resumes
    in an Accelerate loop on one process, which saves after 2 batches of 3; a second one
    resumes that save at the same world size from the position too (not the per-rank replay,
    which knows nothing of the split rest): over the epoch every sample once."""
    samplers = [ResumableDistributedSampler(_Ids(), num_replicas=2, rank=r, seed=5) for r in range(2)]
    consumed = []
    for s in samplers:
        it = iter(s)
        consumed += [next(it) for _ in range(4)]
        s.advance(4)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": nn.Linear(2, 1), "extra": {"data_position": {"0": samplers[0]}}}).wait()
    first = _accelerate_leg(tmp_path, take=2)
    second = _accelerate_leg(tmp_path, take=None)
    assert len(first) == 6 and Counter(consumed + first + second) == Counter(range(30)), (consumed, first, second)


@pytest.mark.parametrize(
    ("n", "order", "match"),
    [(31, "distributed", "is over 30 samples, this DataLoader's dataset has 31"), (30, "generator", "'generator'")],
)
def test_a_position_the_loader_cannot_resume_is_refused_with_the_remedy(
    tmp_path: Path, n: int, order: str, match: str
) -> None:
    """Another dataset length, or an order only another sampler draws (a plain shuffled
    loader's generator, here against Accelerate's seedable sampler): refused, naming the
    loader, the rank and how to start the epoch afresh."""
    sampler = ResumableDistributedSampler(_Ids(), num_replicas=1, rank=0, seed=5)
    position = {**sampler.state_dict(), "order": order}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": nn.Linear(2, 1), "extra": {"data_position": {"0": position}}}).wait()
    with pytest.raises(StateMismatchError, match=f"DataLoader 0 \\(rank 0\\).*{match}.*resume_dataloaders=False"):
        _accelerate_leg(tmp_path, take=None, n=n)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"consumed": -6}, "consumed -6 is not an int within \\[0, 30\\]"),
        ({"consumed": 31}, "consumed 31 is not an int within \\[0, 30\\]"),
        ({"consumed": "6"}, "consumed '6' is not an int within \\[0, 30\\]"),
        ({"epoch": -1}, "epoch -1 is not an int"),
        ({"epoch": True}, "epoch True is not an int"),
        ({"seed": 2**64 - 3, "epoch": 5}, "epoch 5 is not an int within \\[0, 2\\]"),
        ({"consumed": None}, "consumed None is not an int"),
    ],
    ids=["negative", "past-the-end", "string", "negative-epoch", "bool-epoch", "seed-overflow", "null"],
)
def test_an_edited_position_is_refused_not_resumed_elsewhere(tmp_path: Path, edit: dict[str, Any], match: str) -> None:
    """A damaged or edited position (a negative count would resume from the epoch's tail and
    skip the rest silently): refused as the sampler refuses it, naming the loader and the rank,
    and nothing of the epoch is taken from it."""
    sampler = ResumableDistributedSampler(_Ids(), num_replicas=1, rank=0, seed=5)
    position = {**sampler.state_dict(), **edit}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": nn.Linear(2, 1), "extra": {"data_position": {"0": position}}}).wait()
    with pytest.raises(StateMismatchError, match=f"DataLoader 0 \\(rank 0\\).*{match}.*resume_dataloaders=False"):
        _accelerate_leg(tmp_path, take=None)
