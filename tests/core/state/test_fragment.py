"""``Fragment``: flat ranges split into boxes that cover exactly the range, in order."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardkeeper.core import CheckpointManager, Fragment
from shardkeeper.core.state.fragment import flat_range_boxes

SHAPES = [(), (1,), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (4, 0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_cover_every_flat_range_exactly_in_order(shape: tuple[int, ...]) -> None:
    total = math.prod(shape)
    index = torch.arange(total).reshape(shape)
    for start, end in itertools.combinations_with_replacement(range(total + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        covered = []
        for offsets, bshape, local_start in boxes:
            region = index[tuple(slice(o, o + n) for o, n in zip(offsets, bshape))]
            assert tuple(region.shape) == tuple(bshape)
            flat = region.reshape(-1).tolist()
            # a box's elements sit contiguously in the fragment, at its stated start
            assert flat == list(range(start + local_start, start + local_start + len(flat)))
            covered += flat
        assert covered == list(range(start, end)), (shape, start, end, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_fragment_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="1-D tensor with unit stride"):
        Fragment(torch.zeros(2, 2), (4,), 0)
    with pytest.raises(ValueError, match="1-D tensor with unit stride"):
        Fragment(torch.zeros(8)[::2], (8,), 0)
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        Fragment(torch.zeros(3), (2, 2), 2)


def test_whole_tensor_fragment_round_trips_into_a_plain_tensor(tmp_path) -> None:
    t = torch.randn(5, 6)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": {"w": Fragment(t.reshape(-1), t.shape, 0)}}, async_save=False)
        target = {"model": {"w": torch.zeros(5, 6)}}
        mgr.restore(target)
        assert torch.equal(target["model"]["w"], t)
        buf = torch.zeros(30)
        mgr.restore({"model": {"w": Fragment(buf, (5, 6), 0)}})
        assert torch.equal(buf, t.reshape(-1))
        part = torch.zeros(13)  # a sub-range restores too (ranks of a later, larger world)
        mgr.restore({"model": {"w": Fragment(part, (5, 6), 9)}}, strict=True)
        assert torch.equal(part, t.reshape(-1)[9:22])


def test_a_fragment_that_does_not_tile_is_refused_at_commit(tmp_path) -> None:
    from shardkeeper.core import CheckpointSaveError

    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointSaveError, match="model/w"):
            mgr.save(1, {"model": {"w": Fragment(torch.zeros(10), (5, 6), 3)}}, async_save=False)
        assert mgr.steps() == []


def test_load_adapter_names_the_package_to_install() -> None:
    from shardkeeper.core.adapter.registry import load_adapter

    with pytest.raises(ImportError, match=r"pip install shardkeeper-nosuch"):
        load_adapter("nosuch")


def test_legacy_pickles_load_only_on_explicit_trust(tmp_path) -> None:
    from shardkeeper.core.state.unpickle import load_trusted_pickle

    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, path)
    for refused in (False, None, "yes", 1):
        with pytest.raises(PermissionError, match="trust_pickle=True"):
            load_trusted_pickle(path, trust_pickle=refused)  # type: ignore[arg-type]
    assert torch.equal(load_trusted_pickle(path, trust_pickle=True)["w"], torch.ones(2))
