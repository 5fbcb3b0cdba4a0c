"""Saving and restoring CUDA state in one process, bit for bit.

Each test runs on ``cuda:0`` (or on the CPU in the dry run, ``tests/cuda/_device.py``): the
blocking and overlapped staging paths, synchronous and background saves, restores across
devices, the reused (pinned, on CUDA) staging buffer, and host memory over repeated saves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CheckpointSaveError, IneffectiveOptionWarning
from tests.checks import assert_same_state, state_of
from tests.cuda._model import devices_of, fresh, fwd_bwd, train_step, trained

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


def restored(mgr: CheckpointManager, step: int, device: Any) -> dict[str, Any]:
    """The state of a fresh model and optimizer on ``device`` after restoring ``step`` into
    them, after checking that every tensor stayed on the device it was on."""
    model, opt = fresh(device)
    before = devices_of(model, opt)
    mgr.restore({"model": model, "optim": opt}, step=step)
    assert devices_of(model, opt) == before, "a restored tensor moved to another device"
    assert next(model.parameters()).device == device
    return state_of(model, opt)


@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize("staging", ["blocking", "overlap"])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_save_restore_bit_exact(tmp_path: Path, device: Any, async_save: bool, staging: str, writer: str) -> None:
    """``writer="process"``: the device-to-host copy lands in shared memory (pinned where the
    driver registers it), and a persist process writes it."""
    model, opt = trained(1, device)
    ref = state_of(model, opt)
    ineffective = staging == "overlap" and not async_save  # a synchronous save has no copy to overlap
    with pytest.warns(IneffectiveOptionWarning) if ineffective else contextlib.nullcontext():
        mgr = CheckpointManager(tmp_path, async_save=async_save, staging=staging, writer=writer)
    with mgr:
        mgr.save(3, {"model": model, "optim": opt}).wait()
        train_step(model, opt, 7)  # the live state moves on; the checkpoint must not
        assert state_of(model, opt)["param/fc1.weight"].ne(ref["param/fc1.weight"]).any()  # control
        got = restored(mgr, 3, device)
    assert got["param/scale"].dtype == torch.bfloat16 and got["buffer/offset"].dtype == torch.bfloat16
    assert "optim/fc1.weight/exp_avg" in got and "optim/scale/exp_avg_sq" in got
    assert_same_state(got, ref)


def test_device_save_restores_into_cpu_targets(tmp_path: Path, device: Any) -> None:
    model, opt = trained(2, device)
    ref = state_of(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt}).wait()
        got = restored(mgr, 1, torch.device("cpu"))
    assert_same_state(got, ref)


def test_cpu_save_restores_into_device_targets(tmp_path: Path, device: Any) -> None:
    model, opt = trained(3, torch.device("cpu"))
    ref = state_of(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt}).wait()
        got = restored(mgr, 1, device)
    assert_same_state(got, ref)


@pytest.mark.parametrize("staging", ["blocking", "overlap"])
def test_staging_buffer_is_pinned_and_reused(tmp_path: Path, device: Any, staging: str) -> None:
    model, opt = trained(4, device)
    state = {"model": model, "optim": opt}
    ptrs = []
    with CheckpointManager(tmp_path, async_save=True, staging=staging, keep_last=2) as mgr:
        for step in range(5):
            mgr.save(step, state).wait()
            buf = mgr._stager._buffer
            assert buf is not None, "a save of device tensors staged nothing"
            if device.type == "cuda":
                assert buf.is_pinned(), "the staging buffer for CUDA sources is not pinned"
            ptrs.append(buf.data_ptr())
        assert len(set(ptrs)) == 1, f"the staging buffer was reallocated across saves: {ptrs}"
        ref = state_of(model, opt)
        got = restored(mgr, 4, device)
    assert_same_state(got, ref)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line in /proc/self/status")


def _pinned_bytes(device: Any) -> int | None:
    """The pinned host allocator's current bytes, or None where torch does not report them."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def _settled(device: Any) -> tuple[int, int | None]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return _rss_bytes(), _pinned_bytes(device)


MIB = 1 << 20


def test_host_memory_does_not_grow_over_saves(tmp_path: Path, device: Any) -> None:
    g = torch.Generator().manual_seed(5)
    state = {"t": {f"w{i}": torch.randn(1 << 20, generator=g).to(device) for i in range(8)}}  # 32 MiB
    with CheckpointManager(tmp_path, async_save=True, keep_last=1) as mgr:
        for step in range(8):
            mgr.save(step, state).wait()
            if step == 1:  # after the 2nd save: the buffer and every cache exist
                rss0, pinned0 = _settled(device)
        rss1, pinned1 = _settled(device)
        assert mgr._stager.buffer_bytes >= 32 * MIB
        last = mgr.load(7)
    assert_same_state(last, state)
    grown = rss1 - rss0
    assert grown < 16 * MIB, f"host RSS grew by {grown / MIB:.1f} MiB over 6 saves of a 32 MiB state"
    if pinned0 is not None:
        assert pinned1 == pinned0, f"pinned host memory grew from {pinned0} to {pinned1} bytes over 6 saves"


# -- overlapped staging on the device ------------------------------------------------------------


def test_overlap_step_waits_for_the_deferred_copy(tmp_path: Path, device: Any, held: threading.Event) -> None:
    model, opt = trained(6, device)
    ref = state_of(model, opt)
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        h = mgr.save(1, {"model": model, "optim": opt})
        assert h.deferred_bytes > 0 and not h.staged()
        fwd_bwd(model, 1)  # accumulation: no step, no wait
        assert not h.staged() and mgr.staging_waits == 0, "an accumulation step waited"
        timer = threading.Timer(0.2, held.set)  # released while the step below already waits
        timer.start()
        try:
            opt.step()  # waits for the copy through the step pre-hook, then mutates
        finally:
            timer.cancel()
            held.set()
        opt.zero_grad()
        assert h.staged() and mgr.staging_waits == 1
        h.wait()
        assert not torch.equal(model.fc1.weight.detach(), ref["param/fc1.weight"])  # control: the step ran
        assert_same_state(restored(mgr, 1, device), ref)


def test_overlap_mutation_racing_the_copy_is_refused(tmp_path: Path, device: Any, held: threading.Event) -> None:
    model, opt = trained(7, device)
    state = {"model": model, "optim": opt}
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        h = mgr.save(4, state)
        with torch.no_grad():
            model.fc2.weight.add_(1.0)  # in place, outside a step, without wait_staged()
        held.set()
        with pytest.raises(CheckpointSaveError) as ei:
            h.wait()
        msg = str(ei.value)
        assert "model/fc2.weight" in msg and "wait_staged" in msg and "step 4" in msg, msg
        assert mgr.steps() == []
        ref = state_of(model, opt)
        mgr.save(5, state).wait()  # the next save commits
        train_step(model, opt, 1)
        assert_same_state(restored(mgr, 5, device), ref)
