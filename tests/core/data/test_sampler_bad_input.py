"""ResumableDistributedSampler refuses what it cannot position, with the rank and the remedy:
an iterable dataset, and a saved position whose epoch or count was damaged or edited."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import Dataset, IterableDataset

from shardkeeper.core import ResumableDistributedSampler, StateMismatchError

pytestmark = pytest.mark.timeout(60)


class _Ids(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


def _position(**edit: Any) -> dict[str, Any]:
    s = ResumableDistributedSampler(_Ids(23), num_replicas=2, rank=0, seed=3)
    it = iter(s)
    for _ in range(4):
        next(it)
    s.advance(4)
    return {**s.state_dict(), **edit}


def test_an_iterable_dataset_is_refused_naming_the_remedy() -> None:
    with pytest.raises(TypeError, match=r"IterableDataset.*map-style.*docs/data\.md"):
        ResumableDistributedSampler(_Stream(), num_replicas=2, rank=0)


@pytest.mark.parametrize("epoch", ["x", -1, 1.5, None, True, 2**64 - 3])  # seed 3 + 2**64 - 3: no generator seed
def test_a_damaged_epoch_is_refused(epoch: Any) -> None:
    s = ResumableDistributedSampler(_Ids(23), num_replicas=3, rank=1, seed=3)
    with pytest.raises(StateMismatchError, match=r"rank 1.*epoch.*damaged or edited.*Restore another step"):
        s.load_state_dict(_position(epoch=epoch))
    assert (s.epoch, len(s)) == (0, 8)  # untouched: the whole of epoch 0


@pytest.mark.parametrize("consumed", [-4, 10**9, "12", 3.5])
def test_a_damaged_count_names_the_rank_and_the_remedy(consumed: Any) -> None:
    s = ResumableDistributedSampler(_Ids(23), num_replicas=3, rank=2, seed=3)
    with pytest.raises(StateMismatchError, match=r"rank 2.*consumed.*damaged or edited.*Restore another step"):
        s.load_state_dict(_position(consumed=consumed))


@pytest.mark.parametrize("state", [[1, 2], "position", None])
def test_a_position_that_is_not_a_mapping_is_refused(state: Any) -> None:
    s = ResumableDistributedSampler(_Ids(23), num_replicas=3, rank=0)
    with pytest.raises(StateMismatchError, match=r"rank 0.*not a sampler position"):
        s.load_state_dict(state)
