"""Overlapped staging in one process: the checkpoint holds the values of the moment ``save()``
was called, whatever happens to the live tensors afterwards.

The background copy is held back deterministically through ``overlap._before_copy`` (a
test seam), so "the mutation ran before the copy" is a fact of each test, not a timing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager, CheckpointSaveError
from shardkeeper.core.save import overlap
from tests.checks import assert_same_state, state_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)  # forward mutates running_mean/var/num_batches_tracked
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def build(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def fwd_bwd(model: nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    fwd_bwd(model, i)
    opt.step()
    opt.zero_grad()


def restored(mgr: CheckpointManager, step: int) -> dict[str, Any]:
    model, opt = build(seed=99)
    train_step(model, opt, 12345)  # creates the optimizer state the restore fills
    mgr.restore({"model": model, "optim": opt}, step=step)
    return state_of(model, opt)


def test_optimizer_step_waits_and_accumulation_does_not(tmp_path: Path, held: threading.Event) -> None:
    model, opt = build(0)
    train_step(model, opt, 0)
    ref = state_of(model, opt)
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        h = mgr.save(1, {"model": model, "optim": opt})
        assert h.deferred_bytes > 0 and not h.staged()
        # Gradient accumulation: forward (BatchNorm stats change) and backward, no step.
        fwd_bwd(model, 1)
        fwd_bwd(model, 2)
        assert not h.staged() and mgr.staging_waits == 0, "an accumulation step waited"
        assert not torch.equal(model.bn.running_mean, ref["buffer/bn.running_mean"])
        held.set()
        opt.step()  # waits for the copy through the step pre-hook, then mutates
        opt.zero_grad()
        assert h.staged() and mgr.staging_waits == 1
        h.wait()
        assert not torch.equal(model.fc1.weight, ref["param/fc1.weight"])  # control
        assert_same_state(restored(mgr, 1), ref)


def test_direct_mutation_after_wait_staged(tmp_path: Path, held: threading.Event) -> None:
    model, opt = build(1)
    train_step(model, opt, 0)
    ref = state_of(model, opt)
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        h = mgr.save(3, {"model": model, "optim": opt})
        held.set()
        mgr.wait_staged()
        assert h.staged()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
            for st in opt.state.values():
                st["exp_avg"].add_(1.0)
        h.wait()
        assert_same_state(restored(mgr, 3), ref)


def test_mutation_racing_the_copy_is_refused(tmp_path: Path, held: threading.Event) -> None:
    model, opt = build(2)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        h = mgr.save(4, state)
        with torch.no_grad():
            model.fc2.weight.add_(1.0)  # in place, outside a step, without wait_staged()
        held.set()
        with pytest.raises(CheckpointSaveError) as ei:
            h.wait()
        msg = str(ei.value)
        assert "model/fc2.weight" in msg and "wait_staged" in msg and "step 4" in msg and "stage" in msg
        assert mgr.steps() == []
        ref = state_of(model, opt)
        mgr.save(5, state).wait()  # the next save commits
        train_step(model, opt, 1)
        assert_same_state(restored(mgr, 5), ref)


def test_failed_copy_surfaces_and_never_blocks_a_step(tmp_path: Path) -> None:
    model, opt = build(3)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}

    def boom() -> None:
        raise RuntimeError("injected staging failure")

    overlap._before_copy = boom
    try:
        with CheckpointManager(tmp_path, staging="overlap") as mgr:
            mgr.save(6, state)
            train_step(model, opt, 1)  # returns: the hook is released even on failure
            with pytest.raises(CheckpointSaveError, match="injected staging failure"):
                mgr.save(7, state)  # the unseen failure of step 6 reaches the next save
            overlap._before_copy = None
            mgr.save(8, state).wait()
            assert mgr.steps() == [8]
    finally:
        overlap._before_copy = None


def test_second_save_and_restore_while_staging(tmp_path: Path) -> None:
    model, opt = build(4)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        ref1 = state_of(model, opt)
        mgr.save(1, state)
        train_step(model, opt, 1)
        ref2 = state_of(model, opt)
        mgr.save(2, state)  # waits for save 1, then stages again into the reused buffer
        train_step(model, opt, 2)
        assert_same_state(restored(mgr, 2), ref2)  # restore waits for the pending save
        assert_same_state(restored(mgr, 1), ref1)
        mgr.save(3, state)
    assert mgr.steps() == [1, 2, 3]  # close() waited for the last one
    assert len(opt._optimizer_step_pre_hooks) == 0, "close() leaves a hook behind"


def test_blocking_is_the_default_and_hooks_follow_the_state(tmp_path: Path) -> None:
    model, opt = build(5)
    train_step(model, opt, 0)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.options.staging == "blocking"
        h = mgr.save(1, {"model": model, "optim": opt})
        assert h.staged() and h.deferred_bytes == 0 and len(opt._optimizer_step_pre_hooks) == 0
    with pytest.raises(ValueError, match="staging='later'"):
        CheckpointManager(tmp_path, staging="later")
    model2, opt2 = build(6)
    train_step(model2, opt2, 0)
    with CheckpointManager(tmp_path, staging="overlap") as mgr:
        mgr.save(2, {"model": model, "optim": opt}).wait()
        mgr.save(3, {"model": model2, "optim": opt2}).wait()
        # One hook per optimizer while it is saved; the first one's is gone.
        assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt2._optimizer_step_pre_hooks) == 1


class Wrapper(torch.optim.Optimizer):
    """Like Accelerate's AcceleratedOptimizer: a torch Optimizer around the real one."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups


class Holder:
    """Like an adapter's state object that holds a framework's inner optimizer."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def shardkeeper_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]


def test_find_optimizers_unwraps_and_asks_holders() -> None:
    from shardkeeper.core import PerRank

    _, a = build(7)
    _, b = build(8)
    _, c = build(9)
    found = overlap.find_optimizers({"x": Wrapper(a), "y": [Holder(b)], "z": PerRank({"o": c}), "a": a})
    assert {id(o) for o in found} == {id(a), id(b), id(c)}
    assert overlap.find_optimizers({"w": torch.zeros(3), "n": 1}) == []


def test_owners_are_the_overlapping_optimizer_tensors() -> None:
    flat = torch.zeros(100)
    a, b = nn.Parameter(flat[:40].view(4, 10)), nn.Parameter(flat[40:].view(6, 10))  # one storage
    opt = torch.optim.SGD([a, b], lr=0.1)
    owned = overlap.OptimizerTensors([opt])
    assert owned.owners(flat[10:20]) == [a]
    assert owned.owners(flat[60:]) == [b]
    assert {id(t) for t in owned.owners(flat[35:45]) or []} == {id(a), id(b)}
    assert owned.owners(torch.zeros(3)) is None
