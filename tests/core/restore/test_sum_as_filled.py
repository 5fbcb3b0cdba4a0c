"""The restore's logical sums run as the reads land (``restore/sum_as_filled.py``): a tensor
is summed once the last read into its memory is done, while later reads go on; tensors that
share memory (tied weights, a view into another) wait for every read into any of them.

One I/O thread and small reads make the order observable: each read and each sum is logged
as it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.restore import flat as restore_flat
from shardkeeper.core.restore import logical_check
from shardkeeper.core.restore import plan as restore_plan
from shardkeeper.core.restore.plan import Op, RestorePlan
from shardkeeper.core.restore.reads import Read

Event = tuple[str, frozenset[str]]


def _keys(item: Any) -> frozenset[str]:
    if isinstance(item, Op):
        return frozenset({item.key})
    if isinstance(item, Read):
        return frozenset(s.key for s in item.segments)
    return frozenset(op.key for op in item)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Event]]:
    """("read", keys written) after each read, ("sum", {key}) before each tensor's sum."""
    log: list[Event] = []
    for name in ("execute_direct", "execute_read", "execute_encoded"):
        original = getattr(restore_flat, name)

        def read(reader: Any, path: str, item: Any, *rest: Any, _fn: Callable[..., None] = original) -> None:
            _fn(reader, path, item, *rest)
            log.append(("read", _keys(item)))

        monkeypatch.setattr(restore_flat, name, read)
    original_sum = logical_check.LogicalCheck.sum

    def summed(self: logical_check.LogicalCheck, key: str) -> None:
        if key in self.tasks:
            log.append(("sum", frozenset({key})))
        original_sum(self, key)

    monkeypatch.setattr(logical_check.LogicalCheck, "sum", summed)
    yield log


def _restore(root: Path, state: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> CheckpointManager:
    mgr = CheckpointManager(root, io_threads=1, max_read_bytes=1 << 16)
    mgr.save(1, state, async_save=False)
    mgr.restore(target, step=1)
    return mgr


def _last(log: list[Event], kind: str, keys: set[str]) -> int:
    return max(i for i, (k, ks) in enumerate(log) if k == kind and ks & keys)


def _first(log: list[Event], kind: str, keys: set[str]) -> int:
    return min(i for i, (k, ks) in enumerate(log) if k == kind and ks & keys)


def test_a_tensor_is_summed_once_its_reads_land_while_later_reads_go_on(tmp_path: Path, events: list[Event]) -> None:
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(128, 512, generator=g) for i in range(4)}  # 256 KiB: 4 reads each
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with _restore(tmp_path / "root", state, target) as mgr:
        stats = mgr.last_restore_stats
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert stats is not None and stats.logical is not None
    assert (stats.logical.checked, stats.logical.problems) == (4, [])
    sums = [next(iter(ks)) for k, ks in events if k == "sum"]
    assert sorted(sums) == sorted(state), events
    reads = [i for i, (k, _) in enumerate(events) if k == "read"]
    assert len(reads) >= 16, events
    first_sum = _first(events, "sum", set(state))
    assert first_sum < reads[-1], f"every sum ran after the last read: {events}"
    for key in state:  # ... and each only after every read into it
        assert _first(events, "sum", {key}) > _last(events, "read", {key}), events


def test_tensors_sharing_memory_are_summed_after_every_read_into_any_of_them(
    tmp_path: Path, events: list[Event]
) -> None:
    g = torch.Generator().manual_seed(1)
    tied, big = torch.randn(64, 1024, generator=g), torch.randn(256, 1024, generator=g)
    state = {"a": tied, "b": tied, "c": big, "d": big[10:20], "e": torch.randn(64, 1024, generator=g)}
    x, y = torch.zeros(64, 1024), torch.zeros(256, 1024)
    target = {"a": x, "b": x, "c": y, "d": y[10:20], "e": torch.zeros(64, 1024)}
    with _restore(tmp_path / "root", state, target) as mgr:
        stats = mgr.last_restore_stats
    assert torch.equal(x, tied) and torch.equal(y, big) and torch.equal(target["e"], state["e"])
    assert stats is not None and stats.logical is not None
    assert (stats.logical.checked, stats.logical.problems) == (5, [])
    for group in ({"a", "b"}, {"c", "d"}):
        assert _first(events, "sum", group) > _last(events, "read", group), (group, events)


def test_a_misplaced_piece_is_caught_when_summed_as_filled(
    tmp_path: Path, events: list[Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tensors' reads swapped by the planner's test hook: each lands in the other's memory,
    so each tensor's sum waits on reads that belong to the other, and both are named."""
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(128, 512, generator=g) for i in range(3)}
    target = {k: torch.zeros_like(v) for k, v in state.items()}

    def swap(plan: RestorePlan) -> None:
        a = [o for o in plan.ops if o.key == "t0"]
        b = [o for o in plan.ops if o.key == "t1"]
        for x, y in zip(a, b):
            x.dest, y.dest = y.dest, x.dest

    with CheckpointManager(tmp_path / "root", io_threads=1, max_read_bytes=1 << 16) as mgr:
        mgr.save(1, state, async_save=False)
        monkeypatch.setattr(restore_plan, "FAULT", swap)
        with pytest.raises(Exception, match="logical digest") as err:
            mgr.restore(target, step=1)
    assert "'t0'" in str(err.value) and "'t1'" in str(err.value)
