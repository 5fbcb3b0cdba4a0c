"""The save-plan cache: reused while the state's structure is unchanged, never stale.

A state of many small tensors costs more to plan than to copy, so a manager reuses its last
plan when every leaf has the same key, kind, shape, dtype and device; the tensors and JSON
values of each save are bound into it. Every case restores and compares bit for bit.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch

from shardkeeper.core import CheckpointManager


def _restored(mgr: CheckpointManager, like: dict[str, Any], step: int) -> dict[str, Any]:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    if "cfg" in target:
        target["cfg"] = {"lr": 0.0}
    assert mgr.restore(target, step=step) == step
    return target


def test_new_tensor_objects_and_values_are_bound_into_the_cached_plan(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        states = [
            {"w": torch.full((64, 3), float(s)), "b": torch.arange(5) + s, "cfg": {"lr": 0.1 * s}} for s in range(4)
        ]
        for step, st in enumerate(states):
            mgr.save(step, st).wait()
        assert mgr._plans.hits == 3
        for step, st in enumerate(states):
            got = _restored(mgr, st, step)
            assert torch.equal(got["w"], st["w"]) and torch.equal(got["b"], st["b"]) and got["cfg"] == st["cfg"]


def test_in_place_changes_between_saves_are_saved(tmp_path: Path) -> None:
    w = torch.zeros(1000)
    with CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            w.add_(1.0)
            mgr.save(step, {"w": w}).wait()
        assert mgr._plans.hits == 2
        for step in range(3):
            assert torch.equal(_restored(mgr, {"w": w}, step)["w"], torch.full((1000,), step + 1.0))


def test_a_structure_change_is_planned_afresh(tmp_path: Path) -> None:
    variants = [
        {"w": torch.ones(8, 4)},
        {"w": torch.ones(4, 8) * 2},  # same element count, another shape
        {"w": torch.ones(8, 4, dtype=torch.float64) * 3},  # another dtype
        {"w": torch.ones(8, 4) * 4, "v": torch.ones(2) * 4},  # a new key
        {"v": torch.ones(2) * 5},  # a key gone
        {"v": torch.ones(2) * 6},  # unchanged again: reused
    ]
    with CheckpointManager(tmp_path) as mgr:
        for step, st in enumerate(variants):
            mgr.save(step, st).wait()
        assert mgr._plans.hits == 1
        for step, st in enumerate(variants):
            got = _restored(mgr, st, step)
            assert all(torch.equal(got[k], v) for k, v in st.items())


def test_states_with_bytes_are_never_cached(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, {"w": torch.ones(4) * step, "blob": bytes([step]) * (step + 1)}).wait()
        assert mgr._plans.hits == 0
        target = {"w": torch.zeros(4), "blob": b""}
        mgr.restore(target, step=2)
    assert target["blob"] == b"\x02\x02\x02" and torch.equal(target["w"], torch.full((4,), 2.0))


def test_the_cache_keeps_no_tensor_of_a_save_alive(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        t = torch.ones(1 << 16)
        ref = weakref.ref(t)
        mgr.save(1, {"w": t}).wait()
        del t
        gc.collect()
        assert ref() is None
        mgr.save(2, {"w": torch.full((1 << 16,), 2.0)}).wait()  # and the cache still serves
        assert mgr._plans.hits == 1
        assert torch.equal(_restored(mgr, {"w": torch.zeros(1 << 16)}, 2)["w"], torch.full((1 << 16,), 2.0))


def test_cached_layouts_serve_interleaved_sync_and_async_saves(tmp_path: Path) -> None:
    """The stager keeps each cached plan's buffer layout (the typed views it copies into);
    synchronous saves stage only small items, async saves all of them, and a larger state in
    between reallocates the buffer: every save still restores bit for bit."""
    from shardkeeper.core.save.stage import DIRECT_MIN_BYTES

    big_n = DIRECT_MIN_BYTES // 4 * 2
    small = {f"s{i}": torch.full((37,), float(i)) for i in range(50)}
    with CheckpointManager(tmp_path) as mgr:
        saved = {}
        for step in range(8):
            st = {**{k: v + step for k, v in small.items()}, "big": torch.full((big_n,), float(step))}
            if step == 4:  # another structure: a larger buffer, then back to the first plan
                st["extra"] = torch.ones(3 * big_n)
            mgr.save(step, st, async_save=step % 2 == 0).wait()
            saved[step] = st
        assert mgr._plans.hits == 5  # steps 1, 2, 3 and 6, 7 (4 and 5 were planned afresh)
        layouts = list(mgr._stager._layouts.values())
        assert {lay.key[1] for lay in layouts} == {(), (0,)}  # async: all staged; sync: "big" (item 0) direct
        for step, st in saved.items():
            got = _restored(mgr, st, step)
            assert all(torch.equal(got[k], v) for k, v in st.items()), step


def test_a_plan_cache_hit_reuses_the_staging_views(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"a": torch.ones(10), "b": torch.zeros(3, 4)}).wait()
        (lay,) = mgr._stager._layouts.values()
        views = list(lay.staged_dsts)
        mgr.save(2, {"a": torch.full((10,), 2.0), "b": torch.ones(3, 4)}).wait()
        (again,) = mgr._stager._layouts.values()
        assert again is lay and all(x is y for x, y in zip(again.staged_dsts, views))
        got = _restored(mgr, {"a": torch.zeros(10), "b": torch.zeros(3, 4)}, 2)
    assert torch.equal(got["a"], torch.full((10,), 2.0)) and torch.equal(got["b"], torch.ones(3, 4))


def test_box_in_finds_narrowed_views_and_refuses_anything_else() -> None:
    """How a cached DTensor plan finds an item's source again: the same box of to_local()."""
    from shardkeeper.core.save.plan import _box_in, _narrowed

    local = torch.arange(120.0).reshape(2, 3, 20)
    for view in (local, local[1:2], local[:, 1:3, 5:9], local[1:2, 2:3, 19:20]):
        box = _box_in(local, view)
        assert box is not None and torch.equal(_narrowed(local, box), view)
        assert _narrowed(local, box).data_ptr() == view.data_ptr()
    assert _box_in(local, local.transpose(0, 1)) is None
    assert _box_in(local, local[:, :, ::2]) is None
    assert _box_in(local, torch.ones(2, 3, 20)) is None
    assert _box_in(local, local.reshape(6, 20)) is None
    overlapping = torch.arange(20.0).expand(3, 20)  # rows alias each other: no unique box
    assert _box_in(overlapping, overlapping[2:3]) is None


def test_sources_are_bound_to_their_items_whatever_the_file_order(tmp_path: Path) -> None:
    """Files hold the widest dtypes first, then keys in order, not the state's order: a cache
    hit binds each item's source across that reordering (and nested dicts)."""

    def state(s: int) -> dict[str, Any]:
        return {
            "z": torch.full((5,), s, dtype=torch.int8),
            "a": torch.arange(3, dtype=torch.float64) + s,
            "m": {"w": torch.full((2, 2), float(s)), "step": s},
            "b": torch.full((4,), s, dtype=torch.int16),
        }

    with CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, state(step)).wait()
        assert mgr._plans.hits == 2
        for step in range(3):
            target = {
                "z": torch.zeros(5, dtype=torch.int8),
                "a": torch.zeros(3, dtype=torch.float64),
                "m": {"w": torch.zeros(2, 2), "step": -1},
                "b": torch.zeros(4, dtype=torch.int16),
            }
            mgr.restore(target, step=step)
            want = state(step)
            assert target["m"]["step"] == step and torch.equal(target["m"]["w"], want["m"]["w"])
            assert all(torch.equal(target[k], want[k]) for k in ("z", "a", "b"))


def test_which_leaves_are_tensors_and_which_are_per_rank_is_part_of_the_structure(tmp_path: Path) -> None:
    """The same keys with a tensor and a JSON value swapped, or a dict that produces the keys a
    PerRank did, are other structures: planned afresh, and saved as what they are now."""
    from shardkeeper.core import PerRank

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"a": torch.ones(3), "b": 5}).wait()
        mgr.save(1, {"a": 5, "b": torch.ones(3) * 2}).wait()
        mgr.save(2, {"p": PerRank({"w": torch.ones(2) * 3})}).wait()
        mgr.save(3, {"p": {"0": {"w": torch.ones(2) * 4}}}).wait()  # rank 0: the same key p/0/w
        assert mgr._plans.hits == 0
        target: dict[str, Any] = {"a": 0, "b": torch.zeros(3)}
        mgr.restore(target, step=1)
        assert target["a"] == 5 and torch.equal(target["b"], torch.ones(3) * 2)
        assert mgr.manifest(2).per_rank_prefixes == ("p",) and mgr.manifest(3).per_rank_prefixes == ()
        t3 = {"p": {"0": {"w": torch.zeros(2)}}}
        mgr.restore(t3, step=3)
        assert torch.equal(t3["p"]["0"]["w"], torch.ones(2) * 4)
