"""ResumableDistributedSampler: DistributedSampler's indices at an unchanged world size, and
every sample of an interrupted epoch seen once when it resumes at another one.

Ranks are simulated in one process by samplers with an explicit ``num_replicas``/``rank``
(what each rank of a job constructs), stepped together as DDP steps them; the last test runs
real gloo ranks: 2 train and save through the manager, 3 restore and finish the epoch.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardkeeper.core import CheckpointManager, ResumableDistributedSampler, StateMismatchError
from shardkeeper.core.adapter import DATA_POSITION_KEY
from shardkeeper.core.data.position import KEYS

from .._launch import run_workers

pytestmark = pytest.mark.timeout(120)

SEED, EPOCH = 7, 2


class _Ids(Dataset[int]):
    """A map-style dataset whose sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _order(n: int, shuffle: bool, epoch: int = EPOCH) -> list[int]:
    """The epoch's global order, as DistributedSampler at world size 1 yields it."""
    s = DistributedSampler(_Ids(n), num_replicas=1, rank=0, shuffle=shuffle, seed=SEED)
    s.set_epoch(epoch)
    return list(s)


def _samplers(n: int, world: int, state: dict[str, Any] | None = None, **kw: Any) -> list[ResumableDistributedSampler]:
    out = []
    for r in range(world):
        s = ResumableDistributedSampler(_Ids(n), num_replicas=world, rank=r, seed=SEED, **kw)
        s.set_epoch(EPOCH)
        if state is not None:
            s.load_state_dict(state)
            s.set_epoch(s.epoch)  # what a resumed loop does: the current epoch stays where it stands
        out.append(s)
    return out


def _leg(samplers: list[ResumableDistributedSampler], steps: int | None) -> tuple[list[int], dict[str, Any]]:
    """Every rank takes ``steps`` indices in turn (None: to the end of the pass), each reported
    consumed; the indices taken, and the position, which every rank must hold alike."""
    its = [iter(s) for s in samplers]
    steps = len(samplers[0]) if steps is None else steps
    seen = []
    for _ in range(steps):
        for s, it in zip(samplers, its):
            seen.append(next(it))
            s.advance(1)
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states), states
    return seen, states[0]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n", [0, 1, 10, 23])
def test_yields_what_distributed_sampler_yields(shuffle: bool, drop_last: bool, n: int) -> None:
    for world in (1, 2, 3, 4, 7):
        for rank in range(world):
            ours = ResumableDistributedSampler(_Ids(n), world, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            ref = DistributedSampler(_Ids(n), world, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            for epoch in (0, 1, 5):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                assert list(ours) == list(ref), (world, rank, epoch)
                assert len(ours) == len(ref)


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_resume_at_the_same_size_continues_the_uninterrupted_order(drop_last: bool) -> None:
    n, world, k = 23, 3, 4
    _, state = _leg(_samplers(n, world, drop_last=drop_last), k)
    assert state["consumed"] == world * k and state["epoch"] == EPOCH
    for r, s in enumerate(_samplers(n, world, state, drop_last=drop_last)):
        ref = DistributedSampler(_Ids(n), world, r, seed=SEED, drop_last=drop_last)
        ref.set_epoch(EPOCH)
        assert list(s) == list(ref)[k:]
        assert len(s) == len(ref) - k
        assert list(s) == list(ref)  # iterated again without set_epoch: the whole epoch, as ref


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("worlds", [(2, 3), (4, 2), (3, 1), (2, 3, 1, 4)], ids=lambda w: "-".join(map(str, w)))
def test_every_sample_once_over_an_epoch_resumed_at_other_sizes(
    worlds: tuple[int, ...], shuffle: bool, drop_last: bool
) -> None:
    n = 23
    seen: list[int] = []
    state = None
    for i, world in enumerate(worlds):
        samplers = _samplers(n, world, state, shuffle=shuffle, drop_last=drop_last)
        last = i == len(worlds) - 1
        before = 0 if state is None else state["consumed"]
        took, state = _leg(samplers, None if last else len(samplers[0]) // 3 + 1)
        seen += took
        assert state["consumed"] == min(before + len(took), n)
    order, left = _order(n, shuffle), n - before
    if drop_last:  # at most once; the last leg drops its tail, fewer than its world size
        assert len(seen) == len(set(seen)) and seen == order[: len(seen)]
        assert n - len(seen) == left % worlds[-1]
    else:  # once each, plus the last leg's padding: the order's first samples, as DistributedSampler
        pad = math.ceil(left / worlds[-1]) * worlds[-1] - left
        assert Counter(seen) == Counter(range(n)) + Counter(order[:pad])
    # The next epoch is the one an uninterrupted run at the last size would yield.
    for r, s in enumerate(_samplers(n, worlds[-1], state, shuffle=shuffle, drop_last=drop_last)):
        ref = DistributedSampler(_Ids(n), worlds[-1], r, shuffle=shuffle, seed=SEED, drop_last=drop_last)
        s.set_epoch(EPOCH + 1)
        ref.set_epoch(EPOCH + 1)
        assert list(s) == list(ref)


def _loader_leg(
    n: int, world: int, state: dict[str, Any] | None, steps: int | None, *, workers: int, count: str, batch: int = 3
) -> tuple[list[int], list[ResumableDistributedSampler]]:
    """A DataLoader per rank over its sampler, stepped together ``steps`` batches (None: all),
    each batch reported consumed when ``count="advanced"``."""
    samplers = _samplers(n, world, state, count=count)
    loaders = [DataLoader(_Ids(n), batch_size=batch, sampler=s, num_workers=workers) for s in samplers]
    its = [iter(dl) for dl in loaders]
    seen: list[int] = []
    for _ in range(len(loaders[0]) if steps is None else steps):
        for s, it in zip(samplers, its):
            got = next(it).tolist()
            seen += got
            if count == "advanced":
                s.advance(len(got))
    del its  # shuts the workers down
    return seen, samplers


@pytest.mark.parametrize(("workers", "count"), [(0, "yielded"), (0, "advanced"), (2, "advanced")])
def test_a_dataloader_resumes_exactly(workers: int, count: str) -> None:
    n, batch, steps = 42, 3, 3
    first, samplers = _loader_leg(n, 2, None, steps, workers=workers, count=count)
    state = samplers[0].state_dict()
    assert state == samplers[1].state_dict() and state["consumed"] == 2 * steps * batch
    rest, samplers = _loader_leg(n, 3, state, None, workers=workers, count=count)
    assert Counter(first + rest) == Counter(range(n))  # 42 - 18 = 24 left: 8 a rank, no padding
    assert samplers[0].state_dict()["consumed"] == n


def test_with_workers_the_yielded_count_runs_ahead_of_the_loop() -> None:
    """Why ``count="advanced"`` is the default: with workers, the DataLoader draws batches of
    indices ahead of the loop, and a count of what the sampler yielded includes them."""
    n, batch, steps = 42, 3, 2
    _, samplers = _loader_leg(n, 2, None, steps, workers=2, count="yielded")
    assert samplers[0].consumed > 2 * steps * batch  # prefetched batches counted as consumed


def test_a_short_last_batch_may_be_reported_at_the_full_batch_size() -> None:
    (s,) = _samplers(10, 1)
    for _ in DataLoader(_Ids(10), batch_size=4, sampler=s):  # 4, 4, 2
        s.advance(4)
    assert s.consumed == 10
    (again,) = _samplers(10, 1, s.state_dict())
    assert len(again) == 0 and list(again) == []


def test_a_position_without_any_advance_warns_once() -> None:
    (s,) = _samplers(10, 1)
    it = iter(s)
    next(it)
    with pytest.warns(RuntimeWarning, match=r"advance\(\) was never called"):
        assert s.state_dict()["consumed"] == 0
    s.state_dict()  # once
    with pytest.raises(ValueError, match="count='yielded'"):
        _samplers(10, 1, count="yielded")[0].advance(1)
    with pytest.raises(TypeError, match="int >= 0"):
        s.advance(-1)


@pytest.mark.parametrize(
    ("kw", "n", "what"),
    [({"seed": SEED + 1}, 23, "seed"), ({}, 24, "dataset_len"), ({"shuffle": False}, 23, "shuffle")],
)
def test_a_position_of_another_order_is_refused(kw: dict[str, Any], n: int, what: str) -> None:
    _, state = _leg(_samplers(23, 2), 2)
    other = ResumableDistributedSampler(_Ids(n), 3, 0, **{"seed": SEED, **kw})
    with pytest.raises(StateMismatchError, match=f"{what}: saved"):
        other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="damaged or edited"):
        _samplers(23, 1)[0].load_state_dict({**state, "consumed": 24})


def test_the_manager_saves_the_position_once_as_replicated_state(tmp_path: Path) -> None:
    """Under the key every adapter reads (``extra/data_position/0``), with every adapter's keys."""
    _, state = _leg(_samplers(23, 2), 3)
    samplers = _samplers(23, 2)
    for s in samplers:
        s.load_state_dict(state)
    with CheckpointManager(tmp_path, process_group="local") as mgr:
        mgr.save(1, {"weights": torch.ones(2), "extra": {"data_position": {"0": samplers[0]}}}).wait()
        manifest = mgr.manifest()
        assert not set(manifest.per_rank_prefixes) & {"extra", "extra/data_position"}
        assert sorted(k for k in manifest.leaves if k.startswith(DATA_POSITION_KEY + "/0/")) == sorted(
            f"{DATA_POSITION_KEY}/0/{k}" for k in KEYS
        )
        assert mgr.load(only=[DATA_POSITION_KEY + "/*"])["extra"]["data_position"]["0"] == state
        assert len(json.dumps(state)) <= 1024
        (resumed,) = _samplers(23, 1)
        resumed.set_epoch(0)
        mgr.restore({"extra": {"data_position": {"0": resumed}}})
    assert resumed.state_dict() == {**state, "world": 1} and resumed.epoch == EPOCH and len(resumed) == 23 - 6


def test_a_position_in_another_samplers_order_is_refused_and_an_unshuffled_one_ignores_the_seed() -> None:
    """An order only its writer can draw (Accelerate's generator, a user's sampler) is refused;
    unshuffled, the order is ``range(n)`` whatever the seed, so the seed is not compared."""
    _, state = _leg(_samplers(23, 2), 2)
    for order in ("generator", "sampler:EpochPermutation"):
        with pytest.raises(StateMismatchError, match=f"another sampler \\('{order}'.*use_seedable_sampler"):
            _samplers(23, 3)[0].load_state_dict({**state, "order": order})
    plain = [ResumableDistributedSampler(_Ids(23), 2, r, shuffle=False, seed=1) for r in range(2)]
    _, state = _leg(plain, 2)
    other = ResumableDistributedSampler(_Ids(23), 3, 0, shuffle=False, seed=5)
    other.load_state_dict(state)
    assert list(other) == list(range(state["consumed"], 23))[0::3]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_ranks_save_three_ranks_finish_the_epoch(tmp_path: Path) -> None:
    """2 gloo ranks train 3 steps with a DataLoader (2 workers) and save through the manager;
    3 ranks restore and finish the epoch: every sample once, then the next epoch at 3."""
    root, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    for world, phase, out in ((2, "first", first), (3, "second", second)):
        out.mkdir()
        res = run_workers(world, "sampler_worker.py", phase, str(root), str(out), timeout_s=240)
        assert res.returncode == 0, res.stdout[-6000:]
    seen = [json.loads((d / f"r{r}.json").read_text()) for d, w in ((first, 2), (second, 3)) for r in range(w)]
    ids = [i for s in seen for i in s["ids"]]
    assert Counter(ids) == Counter(range(60)), sorted(ids)
    assert [len(s["ids"]) for s in seen] == [12, 12, 12, 12, 12]
    assert all(s["next_epoch_ok"] for s in seen[2:]) and all(s["consumed"] == 60 for s in seen[2:])
    with CheckpointManager(root, process_group="local") as mgr:
        saved = mgr.load(only=["sampler/*"])["sampler"]
        assert "sampler" not in mgr.manifest().per_rank_prefixes
    assert saved["consumed"] == 24 and saved["epoch"] == 1 and len(json.dumps(saved)) <= 1024
