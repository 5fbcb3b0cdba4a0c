"""Large tensors start on 64 bytes in shard files and in the staging buffer (decisions.md D20).

The staging copy is fastest when source and destination are equally aligned, and torch
allocates on 64 bytes; the buffer mirrors the file's data section, so the file carries the
alignment gaps too, declared as zero-filled uint8 tensors (safetensors allows no holes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.safetensors import (
    ITEM_ALIGN,
    ITEM_ALIGN_MIN_BYTES,
    PAD_PREFIX,
    build_header,
    data_offsets,
)


def _state(scale: float) -> dict[str, torch.Tensor]:
    # sizes that are no multiple of 64 bytes, so that every large tensor after the first needs a gap
    return {
        "a": torch.arange(ITEM_ALIGN_MIN_BYTES // 4 + 3, dtype=torch.float32) * scale,
        "b": torch.arange(3 * ITEM_ALIGN_MIN_BYTES // 8 + 1, dtype=torch.float64) * scale,
        "c": torch.arange(300_001, dtype=torch.float32).reshape(1, -1) * scale,
        "small": torch.arange(7, dtype=torch.int16) + int(scale),
    }


def _header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n


def _check_files(step_dir: Path, state: dict[str, torch.Tensor]) -> None:
    files = sorted((step_dir / "data").iterdir())
    assert files
    loaded: dict[str, torch.Tensor] = {}
    pads = 0
    for f in files:
        header, start = _header(f)
        raw = f.read_bytes()
        for name, e in header.items():
            if name == "__metadata__":
                continue
            a, b = e["data_offsets"]
            if name.startswith(PAD_PREFIX):
                pads += 1
                assert 0 < b - a < ITEM_ALIGN and raw[start + a : start + b] == bytes(b - a), name
            elif b - a >= ITEM_ALIGN_MIN_BYTES:
                assert a % ITEM_ALIGN == 0, (name, a)
        loaded.update(load_file(str(f)))  # still a valid safetensors file: no holes
    assert pads >= 2
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_data_offsets_align_only_large_items() -> None:
    big = ITEM_ALIGN_MIN_BYTES
    rel, end = data_offsets([3, big + 1, 5, big], align_items=True)
    assert rel == [0, 64, 64 + big + 1, -(-(64 + big + 6) // 64) * 64]
    assert end == rel[-1] + big
    assert data_offsets([3, big + 1], align_items=False) == ([0, 3], big + 4)
    header, offs = build_header([("x", "int8", [3], 3), ("y", "uint8", [big + 1], big + 1)], align_items=True)
    (n,) = struct.unpack("<Q", header[:8])
    parsed = json.loads(header[8 : 8 + n])
    assert parsed[f"{PAD_PREFIX}3"] == {"dtype": "U8", "shape": [61], "data_offsets": [3, 64]}
    assert offs == [8 + n, 8 + n + 64]


@pytest.mark.parametrize("async_save", [True, False])
def test_large_tensors_start_on_64_bytes_and_files_stay_safetensors(tmp_path: Path, async_save: bool) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            state = _state(float(step))
            mgr.save(step, state, async_save=async_save).wait()
            if async_save:  # the buffer mirrors the file: large items are aligned in memory too
                (lay,) = mgr._stager._layouts.values()
                ptrs = [
                    d.data_ptr() % ITEM_ALIGN
                    for d, j in zip(lay.staged_dsts, lay.staged)
                    if d.numel() * d.element_size() >= ITEM_ALIGN_MIN_BYTES
                ]
                assert len(ptrs) == 3 and set(ptrs) == {0}
            _check_files(tmp_path / f"step-{step:012d}", state)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            assert mgr.restore(target, step=step) == step
            assert all(torch.equal(target[k], v) for k, v in state.items())
        assert mgr._plans.hits == 1


def test_gaps_are_zero_after_another_layout_used_the_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous save of the same plan has its own layout in the same buffer (it stages
    only the tensors under 1 MiB, packed differently) and writes over the async layout's gaps;
    the next async save zeroes them again before they are written."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1.0)).wait()
        mgr.save(2, _state(2.0), async_save=False)
        async_layout = next(lay for lay in mgr._stager._layouts.values() if not lay.key[1])
        assert any(p.any() for p in async_layout.pads)  # the synchronous layout wrote there
        mgr.save(3, _state(3.0)).wait()
        assert mgr._plans.hits == 2 and len(mgr._stager._layouts) == 2
        # The same layout twice in a row: its gaps are still zero, so they are not zeroed again.
        zeroed = []
        real = torch._foreach_zero_
        monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (zeroed.append(len(ts)), real(ts)))
        mgr.save(4, _state(4.0)).wait()
        assert zeroed == []
        mgr.save(5, _state(5.0), async_save=False)  # the synchronous layout zeroes its own gaps ...
        mgr.save(6, _state(6.0)).wait()  # ... and the async one must zero its gaps again
        assert len(zeroed) == 2 and zeroed[-1] == len(async_layout.pads)
    for step in range(1, 7):
        _check_files(tmp_path / f"step-{step:012d}", _state(float(step)))


def test_a_staging_copy_that_failed_part_way_leaves_the_gaps_to_be_zeroed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another layout's copy wrote over this layout's gaps and then failed: the next save of
    this layout must still zero them (the buffer is nobody's until a copy succeeds)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1.0)).wait()
        real = torch._foreach_copy_

        def copy_then_fail(dsts: Any, srcs: Any, **kw: Any) -> None:
            real(dsts, srcs, **kw)
            raise RuntimeError("injected: the copy failed after writing")

        monkeypatch.setattr(torch, "_foreach_copy_", copy_then_fail)
        with pytest.raises(RuntimeError, match="injected"):
            mgr.save(2, _state(2.0), async_save=False)  # the synchronous layout, packed otherwise
        monkeypatch.setattr(torch, "_foreach_copy_", real)
        async_layout = next(lay for lay in mgr._stager._layouts.values() if not lay.key[1])
        assert any(p.any() for p in async_layout.pads)  # the failed copy wrote there
        mgr.save(3, _state(3.0)).wait()
    for step in (1, 3):
        _check_files(tmp_path / f"step-{step:012d}", _state(float(step)))


def test_a_restore_reads_through_the_gaps(tmp_path: Path) -> None:
    """Gaps under 64 bytes do not split a coalesced read: a few bytes more, not more requests."""
    n = ITEM_ALIGN_MIN_BYTES // 4 + 1  # 64 KiB + 4 bytes: the second tensor starts after a gap
    state = {"p": torch.arange(n, dtype=torch.float32), "q": torch.arange(n + 2, dtype=torch.float32) * -1}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(target)
        stats = mgr.last_restore_stats
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert stats is not None and stats.reads == 1, stats
    assert 0 < stats.bytes_read - stats.bytes_needed < ITEM_ALIGN, stats


def test_a_state_key_may_not_take_the_padding_prefix(tmp_path: Path) -> None:
    from shardkeeper.core.errors import StateMismatchError

    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError, match="reserve for alignment padding"):
        mgr.save(1, {f"{PAD_PREFIX}64": torch.ones(2)})


def test_parameters_saved_as_leaves_keep_the_staging_buffer_out_of_autograd(tmp_path: Path) -> None:
    """Raw nn.Parameters (requires_grad) are copied without recording a graph: the staging
    views would otherwise join autograd and every later save would build a graph."""
    model = torch.nn.Linear(8, 4)
    params = dict(model.named_parameters())
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, params, async_save=False)
        mgr.save(2, {"weight": params["weight"]}, async_save=False)  # another layout, same buffer
        mgr.save(3, params).wait()
        for lay in mgr._stager._layouts.values():
            assert not any(d.requires_grad for d in lay.staged_dsts)
        target = {k: torch.zeros_like(v) for k, v in params.items()}
        mgr.restore(target, step=3)
    assert all(torch.equal(target[k], v.detach()) for k, v in params.items())
