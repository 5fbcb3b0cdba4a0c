"""``CheckpointManager`` in one process (no process group): what a training script relies on.

Round trips of a real training state (module, AdamW, scheduler, RNG, plain values, bytes,
numpy) bit for bit; async saves that snapshot the state before returning; back-pressure and
ordering; background failures that reach the caller exactly once and leave nothing visible;
corruption caught on restore, with the fallback to the previous step; clear errors on bad
input; the fenced commit; partial restores that read only what they need; retention.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkeeper.core import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    ChecksumMismatchError,
    CommitConflictError,
    CorruptCheckpointError,
    IncompatibleFormatError,
    RNGState,
    StateMismatchError,
    StorageError,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.faults import FaultyStorage
from tests.checks import assert_same_state

# ------------------------------------------------------------------------------- helpers


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class BigNet(nn.Module):
    """A small ``fc1`` next to two big layers: reading the big ones would show in the bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.big1 = nn.Linear(512, 512)
        self.big2 = nn.Linear(512, 512)
        self.head = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = F.pad(h, (0, 512 - 16))
        return self.head(torch.tanh(self.big2(torch.tanh(self.big1(h)))))


_DATA_GEN = torch.Generator().manual_seed(1234)
_BATCHES = [(torch.randn(16, 8, generator=_DATA_GEN), torch.randn(16, 4, generator=_DATA_GEN)) for _ in range(8)]


def build(seed: int, *, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.99), net: type = Net):
    torch.manual_seed(seed)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, i: int) -> float:
    x, y = _BATCHES[i % len(_BATCHES)]
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class SpyStorage:
    """Wraps any Storage: records reads and commits, and can slow down shard-file writers."""

    def __init__(self, inner: Any, *, write_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.write_delay_s = write_delay_s
        self.reads: list[tuple[str, int]] = []  # (path, bytes) of every read
        self.commits: list[str] = []  # paths of successful put_if_absent calls, in order
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def capabilities(self) -> Any:
        return self.inner.capabilities

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _record(self, path: str, n: int) -> None:
        with self._lock:
            self.reads.append((path, n))

    def read_bytes(self, path: str) -> bytes:
        data = self.inner.read_bytes(path)
        self._record(path, len(data))
        return data

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        data = self.inner.read_range(path, offset, length)
        self._record(path, len(data))
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(path, offset, buffer)
        self._record(path, memoryview(buffer).nbytes)

    def open_writer(self, path: str) -> Any:
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        return self.inner.open_writer(path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.inner.put_if_absent(path, data)
        with self._lock:
            self.commits.append(path)

    def data_reads(self) -> list[tuple[str, int]]:
        return [(p, n) for p, n in self.reads if "/data/" in p]


def manifest_json(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "manifest.json").read_text())


def data_files(root: Path, step: int) -> set[str]:
    d = root / step_dir(step) / "data"
    return {f"data/{p.name}" for p in d.iterdir()} if d.exists() else set()


def tensor_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "meta": {"seed": seed}}


# ------------------------------------------------------------------------ 1. round trip


def _full_state(model, opt, sched, *, step, epoch, blob, arr, lst):
    return {
        "model": model,
        "optim": opt,
        "progress": {"step": step, "epoch": epoch},
        "extra": {"blob": blob, "arr": arr, "lst": lst},
        "rng": RNGState(),
        "sched": sched,
    }


def test_round_trip_of_a_training_state(storage_root) -> None:
    model, opt, sched = build(0)
    for i in range(3):
        train_step(model, opt, sched, i)
    arr = np.arange(12, dtype=np.float64).reshape(3, 4) * 1.5
    lst = [torch.arange(5, dtype=torch.int64), torch.randn(2, 3)]
    state = _full_state(model, opt, sched, step=7, epoch=1, blob=b"\x00\x01", arr=arr, lst=lst)

    saved_params = params_of(model)
    saved_optim = copy.deepcopy(opt.state_dict())
    saved_sched = copy.deepcopy(sched.state_dict())
    saved_lst = [t.clone() for t in lst]
    torch.manual_seed(4242)  # the RNG state the checkpoint must carry
    np.random.seed(4242)
    random.seed(4242)

    with CheckpointManager(storage_root.url, storage_options=storage_root.options) as mgr:
        h = mgr.save(7, state)
        h.wait()
        assert h.done()
        assert mgr.steps() == [7]
        # What the uninterrupted run sees next: its random draws and two more steps.
        draws = (torch.rand(5), np.random.rand(3), random.random())
        ref_losses = [train_step(model, opt, sched, i) for i in (3, 4)]
        ref_params = params_of(model)

    # A fresh process: another seed, other hyperparameters, default values everywhere.
    model2, opt2, sched2 = build(1, lr=0.5, betas=(0.5, 0.6))
    arr2 = np.zeros((3, 4), dtype=np.float64)
    lst2 = [torch.zeros(5, dtype=torch.int64), torch.zeros(2, 3)]
    fresh = _full_state(model2, opt2, sched2, step=0, epoch=0, blob=b"", arr=arr2, lst=lst2)
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)

    with CheckpointManager(storage_root.url, storage_options=storage_root.options) as mgr:
        assert mgr.restore(fresh) == 7

    assert_same_state(model2.state_dict(), saved_params, what="parameters")
    assert_same_state(opt2.state_dict(), saved_optim, what="optimizer state")
    assert isinstance(opt2.param_groups[0]["betas"], tuple)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.99)
    assert opt2.param_groups[0]["lr"] == saved_optim["param_groups"][0]["lr"]
    assert sched2.state_dict() == saved_sched
    assert sched2.get_last_lr() == saved_sched["_last_lr"]
    assert fresh["progress"] == {"step": 7, "epoch": 1}
    assert fresh["extra"]["blob"] == b"\x00\x01" and isinstance(fresh["extra"]["blob"], bytes)
    # numpy and list tensors are filled in place, in the caller's own objects
    assert fresh["extra"]["arr"] is arr2 and np.array_equal(arr2, arr)
    assert fresh["extra"]["lst"] is lst2
    assert lst2[0] is fresh["extra"]["lst"][0]
    for got, want in zip(lst2, saved_lst):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # RNG: the same draws as right after the save
    assert torch.equal(torch.rand(5), draws[0])
    assert np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]
    # Training continues exactly as if it had never stopped.
    losses = [train_step(model2, opt2, sched2, i) for i in (3, 4)]
    assert losses == ref_losses
    assert_same_state(model2.state_dict(), ref_params, what="parameters")


# ---------------------------------------------------------------------- 2. async saves


def test_async_save_snapshots_the_state_before_returning(tmp_path: Path) -> None:
    root = tmp_path / "root"
    spy = SpyStorage(LocalStorage(root, fsync=False), write_delay_s=0.4)
    model, opt, sched = build(0)
    train_step(model, opt, sched, 0)
    state = {"model": model, "optim": opt, "progress": {"step": 1, "tags": ["a"]}}
    before_params = params_of(model)
    before_optim = copy.deepcopy(opt.state_dict())

    with CheckpointManager(spy) as mgr:
        h = mgr.save(1, state)
        assert not h.done(), "save() should return once staged, before the (slow) write"
        # The training loop goes on at once: parameters, moments and plain values change.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        for st in opt.state.values():
            st["exp_avg"].mul_(-3.0)
            st["exp_avg_sq"].add_(7.0)
        state["progress"]["step"] = 999
        state["progress"]["tags"].append("b")
        with pytest.raises(CheckpointTimeoutError) as e:
            h.wait(timeout_s=0.01)
        assert isinstance(e.value, TimeoutError) and "step 1" in str(e.value)
        h.wait()
        assert h.done()
        assert mgr.steps() == [1]

        model2, opt2, _ = build(1)
        fresh = {"model": model2, "optim": opt2, "progress": {"step": 0, "tags": []}}
        assert mgr.restore(fresh) == 1
    assert_same_state(model2.state_dict(), before_params, what="parameters")
    assert_same_state(opt2.state_dict(), before_optim, what="optimizer state")
    assert fresh["progress"] == {"step": 1, "tags": ["a"]}


def test_restore_right_after_an_async_save_sees_it(tmp_path: Path) -> None:
    spy = SpyStorage(LocalStorage(tmp_path / "root", fsync=False), write_delay_s=0.3)
    with CheckpointManager(spy) as mgr:
        state = tensor_state(1)
        h = mgr.save(1, state)
        assert not h.done()
        target = {"w": torch.zeros(3, 4), "meta": {"seed": 0}}
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], state["w"]) and target["meta"] == {"seed": 1}


def test_sync_save_returns_after_the_commit(tmp_path: Path) -> None:
    spy = SpyStorage(LocalStorage(tmp_path / "root", fsync=False), write_delay_s=0.2)
    with CheckpointManager(spy) as mgr:
        h = mgr.save(1, tensor_state(1), async_save=False)
        assert h.done()
        assert mgr.steps() == [1]
        assert (tmp_path / "root" / step_dir(1) / "manifest.json").exists()
    with CheckpointManager(spy, async_save=False) as mgr:
        h = mgr.save(2, tensor_state(2))
        assert h.done()
        assert mgr.steps() == [1, 2]
        # async_save=True on the call overrides the manager's option
        h = mgr.save(3, tensor_state(3), async_save=True)
        assert not h.done()
        h.wait()
        assert mgr.steps() == [1, 2, 3]


# --------------------------------------------------------- 3. back-pressure and ordering


def test_saves_in_a_row_commit_in_order_with_back_pressure(tmp_path: Path) -> None:
    root = tmp_path / "root"
    delay = 0.3
    spy = SpyStorage(LocalStorage(root, fsync=False), write_delay_s=delay)
    states = {s: tensor_state(s) for s in (1, 2, 3, 4)}
    with CheckpointManager(spy) as mgr:
        handles, returned = [], []
        for s in (1, 2, 3, 4):
            handles.append(mgr.save(s, states[s]))
            returned.append(time.perf_counter())
        assert all(h.stall_s > 0 for h in handles)
        # Each save after the first waited for the previous one, whose write takes at least
        # `delay` after its save() returned: that wait is its stall.
        for i in (1, 2, 3):
            called_after = returned[i] - handles[i].stall_s - returned[i - 1]
            assert handles[i].stall_s >= delay - called_after - 0.02, (i, handles[i], called_after)
        assert [h.step for h in handles] == [1, 2, 3, 4]
        mgr.wait()
        for h in handles:
            assert h.done()
            h.wait()
        assert spy.commits == [f"{step_dir(s)}/manifest.json" for s in (1, 2, 3, 4)]
        assert mgr.steps() == [1, 2, 3, 4]
        for s in (1, 2, 3, 4):
            target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
            assert mgr.restore(target, step=s) == s
            assert torch.equal(target["w"], states[s]["w"]) and target["meta"] == {"seed": s}


# ---------------------------------------------------------- 4. background failures


def test_write_failure_is_raised_by_every_wait_and_once_by_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "root"
    faulty = FaultyStorage(LocalStorage(root), fail_on={"open_writer": "*/data/*"}, times=1)
    with CheckpointManager(faulty) as mgr:
        h = mgr.save(1, tensor_state(1))
        with pytest.raises(CheckpointSaveError) as e:
            h.wait()
        msg = str(e.value)
        assert "step 1" in msg and "rank 0" in msg and "write" in msg
        assert str(root / step_dir(1)) in msg
        assert e.value.step == 1
        assert set(e.value.failures) == {0} and e.value.failures[0]["phase"] == "write"
        assert faulty.injected and faulty.injected[0][0] == "open_writer"
        with pytest.raises(CheckpointSaveError):
            h.wait()  # a failed save stays failed
        mgr.wait()  # the manager does not raise what the handle already delivered
        assert not (root / step_dir(1) / "manifest.json").exists()
        assert mgr.steps() == []

        h2 = mgr.save(2, tensor_state(2))
        h2.wait()
        assert mgr.steps() == [2]
    assert not (root / step_dir(1) / "manifest.json").exists()


def test_unwaited_write_failure_is_raised_by_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    faulty = FaultyStorage(LocalStorage(root), fail_on={"open_writer": "*/data/*"}, times=1)
    with CheckpointManager(faulty) as mgr:
        h1 = mgr.save(1, tensor_state(1))
        with pytest.raises(CheckpointSaveError) as e:
            mgr.save(2, tensor_state(2))
        assert e.value.step == 1 and "step 1" in str(e.value) and "write" in str(e.value)
        with pytest.raises(CheckpointSaveError):
            h1.wait()  # the handle still says the save failed
        # The failed save() did not save step 2; the next one does, without raising again.
        h2 = mgr.save(2, tensor_state(2))
        h3 = mgr.save(3, tensor_state(3))
        h3.wait()
        h2.wait()
        assert mgr.steps() == [2, 3]


def test_unwaited_write_failure_is_raised_by_manager_wait(tmp_path: Path) -> None:
    faulty = FaultyStorage(LocalStorage(tmp_path / "root"), fail_on={"open_writer": "*/data/*"}, times=1)
    with CheckpointManager(faulty) as mgr:
        h = mgr.save(1, tensor_state(1))
        with pytest.raises(CheckpointSaveError, match="step 1"):
            mgr.wait()
        mgr.wait()  # delivered by the manager once
        with pytest.raises(CheckpointSaveError):
            h.wait()  # the handle still says so
        assert mgr.steps() == []


def test_commit_failure_leaves_no_manifest_and_no_data(tmp_path: Path) -> None:
    root = tmp_path / "root"
    faulty = FaultyStorage(LocalStorage(root), fail_on={"put_if_absent": "*/manifest.json"}, times=1)
    with CheckpointManager(faulty) as mgr:
        h = mgr.save(1, tensor_state(1))
        with pytest.raises(CheckpointSaveError) as e:
            h.wait()
        msg = str(e.value)
        assert "step 1" in msg and "commit" in msg and "rank 0" in msg
        assert str(root / step_dir(1)) in msg
        assert e.value.step == 1
        assert faulty.injected == [("put_if_absent", f"{step_dir(1)}/manifest.json")]
        assert not (root / step_dir(1) / "manifest.json").exists()
        assert data_files(root, 1) == set(), "the failed attempt's shard files were left behind"
        assert mgr.steps() == []
        with pytest.raises(CheckpointSaveError):
            h.wait()
        # Retrying the same step works.
        state = tensor_state(11)
        mgr.save(1, state).wait()
        assert mgr.steps() == [1]
        target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
        assert mgr.restore(target) == 1 and torch.equal(target["w"], state["w"])


# ------------------------------------------------------------------ 5. corruption


def test_corrupt_chunk_is_caught_and_latest_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    m1, o1, s1 = build(0)
    train_step(m1, o1, s1, 0)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"model": m1, "optim": o1}).wait()
        p1 = params_of(m1)
        opt1 = copy.deepcopy(o1.state_dict())
        train_step(m1, o1, s1, 1)
        mgr.save(2, {"model": m1, "optim": o1}).wait()
        p2 = params_of(m1)
    assert not all(torch.equal(p1[k], p2[k]) for k in p1)

    key = "model/fc1.weight"
    chunk = manifest_json(root, 2)["leaves"][key]["chunks"][0]
    path = root / step_dir(2) / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["offset"] + chunk["length"] // 2] ^= 0x40
    path.write_bytes(bytes(raw))

    m2, o2, _ = build(5)
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [1, 2]
        with pytest.raises(ChecksumMismatchError) as e:
            mgr.restore({"model": m2, "optim": o2}, step=2)
        msg = str(e.value)
        assert repr(key) in msg or key in msg
        assert chunk["file"] in msg and "step 2" in msg
        assert e.value.key == key and e.value.file.endswith(chunk["file"])
        assert isinstance(e.value, ValueError)

        with pytest.warns(UserWarning, match=r"step 2 .*damaged.*falling back"):
            got = mgr.restore({"model": m2, "optim": o2})
        assert got == 1
    assert_same_state(m2.state_dict(), p1, what="parameters")
    assert_same_state(o2.state_dict(), opt1, what="optimizer state")


def _damage_newest(root: Path, mode: str) -> str:
    """Save steps 1 and 2 of ``{"w": ...}`` first; damage step 2's shard file; return its name."""
    rel = manifest_json(root, 2)["leaves"]["w"]["chunks"][0]["file"]
    path = root / step_dir(2) / rel
    if mode == "delete":
        path.unlink()
    else:  # truncate: the last bytes of the file (the chunk's tail) are gone
        path.write_bytes(path.read_bytes()[:-4])
    return rel


def _two_steps(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    s1, s2 = tensor_state(1), tensor_state(2)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, s1).wait()
        mgr.save(2, s2).wait()
    return s1, s2


@pytest.mark.parametrize("mode", ["delete", "truncate"])
def test_damaged_shard_file_latest_falls_back(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    s1, _ = _two_steps(root)
    _damage_newest(root, mode)
    with CheckpointManager(str(root)) as mgr:
        target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
        with pytest.raises(CheckpointError):
            mgr.restore(target, step=2)  # asked by number: no fallback
        with pytest.warns(UserWarning, match=r"step 2 .*damaged.*falling back"):
            assert mgr.restore(target) == 1
    assert torch.equal(target["w"], s1["w"]) and target["meta"] == {"seed": 1}


def test_restore_of_the_newest_step_reads_only_its_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """restore() without step= finds the newest step by listing, not by reading and validating
    every manifest of the root; a damaged newest manifest falls back, with a warning."""
    import shardkeeper.core.commit.committed as commit_mod
    import shardkeeper.core.manager.manager as manager_mod

    root = tmp_path / "root"
    states = {s: tensor_state(s) for s in range(1, 6)}
    with CheckpointManager(str(root)) as mgr:
        for s, st in states.items():
            mgr.save(s, st).wait()
    loaded: list[int] = []
    real = commit_mod.load_manifest

    def counting(storage: Any, step: int) -> Any:
        loaded.append(step)
        return real(storage, step)

    monkeypatch.setattr(commit_mod, "load_manifest", counting)  # committed_steps' is_committed
    monkeypatch.setattr(manager_mod, "load_manifest", counting)
    target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
    with CheckpointManager(str(root)) as mgr:
        assert mgr.restore(target) == 5
        assert loaded == [5]
        assert torch.equal(target["w"], states[5]["w"])
        (root / step_dir(5) / "manifest.json").write_bytes(b'{"format_version": 5, "step": ')  # damaged
        assert mgr.steps() == [1, 2, 3, 4]  # steps() lists only what validates
        loaded.clear()
        assert mgr.latest_step() == 4 and loaded == [5, 4]
        assert not mgr.is_committed(5) and mgr.is_committed(3) and not mgr.is_committed(9)
        loaded.clear()
        with pytest.warns(UserWarning, match=r"step 5 .*damaged.*falling back"):
            assert mgr.restore(target) == 4  # (and quarantines step 5: tests/core/restore/test_damaged_newest.py)
        assert loaded == [5, 4]
        assert torch.equal(target["w"], states[4]["w"]) and target["meta"] == {"seed": 4}


@pytest.mark.parametrize("what", ["data", "manifest"])
def test_a_failing_storage_is_raised_not_taken_for_damage(tmp_path: Path, what: str) -> None:
    """When reads of the newest step fail (retries spent) while its files are whole, restore()
    raises, naming the step, the rank and the remedy: falling back would resume from older
    state and lose the newer step's progress. Once the storage answers, the newest restores."""
    root = tmp_path / "root"
    s1, s2 = _two_steps(root)
    pattern = {
        "data": {"read_into": f"*{step_dir(2)}/data/*"},
        "manifest": {"read_bytes": f"*{step_dir(2)}/manifest.json"},
    }[what]
    faulty = FaultyStorage(LocalStorage(root), fail_on=pattern)
    target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
    with CheckpointManager(faulty, retry_max_attempts=2, retry_base_delay_s=0.0) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "falling back" warning either
            with pytest.raises(StorageError) as e:
                mgr.restore(target)
        msg = str(e.value)
        assert "step 2" in msg and "rank 0" in msg and "retry" in msg.lower() and "step=" in msg
        assert target["meta"] == {"seed": -1}  # step 1 was not restored instead
        assert faulty.injected
    with CheckpointManager(str(root)) as mgr:
        assert mgr.restore(target) == 2
    assert torch.equal(target["w"], s2["w"]) and target["meta"] == {"seed": 2}


@pytest.mark.parametrize("mode", ["delete", "truncate"])
def test_damaged_shard_file_error_names_key_file_step_and_remedy(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    _two_steps(root)
    rel = _damage_newest(root, mode)
    with CheckpointManager(str(root)) as mgr:
        with pytest.raises(CheckpointError) as e:
            mgr.restore({"w": torch.zeros(3, 4), "meta": {"seed": -1}}, step=2)
    msg = str(e.value)
    assert rel.rsplit("/", 1)[-1] in msg
    assert "'w'" in msg and "step 2" in msg
    assert re.search(r"earlier step|previous|another step|shardkeeper verify", msg), msg
    # Damage, not absence: a resume loop catching FileNotFoundError must not start from scratch.
    assert isinstance(e.value, CorruptCheckpointError) and not isinstance(e.value, FileNotFoundError)


# ---------------------------------------------------------------- 6. bad input


def test_empty_root_raises_not_found(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == []
        with pytest.raises(CheckpointNotFoundError) as e:
            mgr.restore(tensor_state(0))
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, CheckpointError)
    msg = str(e.value)
    assert str(root) in msg and "no committed checkpoint" in msg
    assert "from scratch" in msg or "Check the root" in msg


def test_missing_step_raises_not_found_naming_the_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, tensor_state(1)).wait()
        target = tensor_state(0)
        with pytest.raises(CheckpointNotFoundError) as e:
            mgr.restore(target, step=5)
        assert isinstance(e.value, FileNotFoundError)
        msg = str(e.value)
        assert "step 5" in msg and str(root) in msg and "shardkeeper ls" in msg
        # No silent fallback to another step when a step was asked for by number.
        assert target["meta"] == {"seed": 0}


def test_a_feature_this_version_does_not_know_asks_for_an_upgrade(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, tensor_state(1)).wait()
    mpath = root / step_dir(1) / "manifest.json"
    m = json.loads(mpath.read_text())
    m["requires"] = ["hologram"]
    mpath.write_text(json.dumps(m))
    with CheckpointManager(str(root)) as mgr:
        for step in (None, 1):
            with pytest.raises(IncompatibleFormatError) as e:
                mgr.restore(tensor_state(0), step=step)
            msg = str(e.value)
            assert "upgrade" in msg and "'hologram'" in msg and str(mpath) in msg


def test_extra_target_key_strict_and_not_strict(tmp_path: Path, caplog) -> None:
    root = tmp_path / "root"
    saved = tensor_state(1)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, saved).wait()
        target = {"w": torch.zeros(3, 4), "meta": {"seed": 0}, "new": {"t": torch.ones(2)}}
        with pytest.raises(StateMismatchError) as e:
            mgr.restore(target)
        msg = str(e.value)
        assert "new/t" in msg and "strict=False" in msg and "step 1" in msg
        assert isinstance(e.value, ValueError)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardkeeper"):
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                assert mgr.restore(target, strict=False) == 1
        told = [str(w.message) for w in record] + [
            r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
        ]
        assert any("new/t" in t for t in told), f"no warning names the skipped key: {told}"
        assert torch.equal(target["w"], saved["w"]) and target["meta"] == {"seed": 1}
        assert torch.equal(target["new"]["t"], torch.ones(2))


def test_shape_mismatch_names_key_and_shapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"model": Net(), "w": torch.randn(3, 4)}).wait()
        for strict in (True, False):
            target = {"model": Net(), "w": torch.zeros(4, 3)}
            with pytest.raises(StateMismatchError) as e:
                mgr.restore(target, strict=strict)
            msg = str(e.value)
            assert "'w'" in msg and "[3, 4]" in msg and "[4, 3]" in msg, msg
            assert "step 1" in msg
            assert torch.equal(target["w"], torch.zeros(4, 3))


def test_shape_mismatch_of_a_module_parameter(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"model": Net(hidden=16)}).wait()
        with pytest.raises(StateMismatchError) as e:
            mgr.restore({"model": Net(hidden=32)})
    msg = str(e.value)
    assert "model/fc" in msg and ("[16, 8]" in msg or "[16]" in msg or "[4, 16]" in msg)


def test_dtype_mismatch_suggests_cast_and_cast_works(tmp_path: Path) -> None:
    root = tmp_path / "root"
    w = torch.randn(3, 4)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"w": w}).wait()
        target = {"w": torch.zeros(3, 4, dtype=torch.float64)}
        with pytest.raises(StateMismatchError) as e:
            mgr.restore(target)
        msg = str(e.value)
        assert "'w'" in msg and "float32" in msg and "float64" in msg and "cast_dtypes=True" in msg
        assert mgr.restore(target, cast_dtypes=True) == 1
        assert target["w"].dtype == torch.float64
        assert torch.equal(target["w"], w.to(torch.float64))
        half = {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}
        mgr.restore(half, cast_dtypes=True)
        assert torch.equal(half["w"], w.to(torch.bfloat16))


class _Opaque:
    pass


@pytest.mark.parametrize(
    "value,key,typename",
    [
        ({"extra": {"tags": {"a", "b"}}}, "extra/tags", "set"),
        ({"extra": {"obj": _Opaque()}}, "extra/obj", "_Opaque"),
        ({"cfg": _Opaque()}, "cfg", "_Opaque"),
    ],
)
def test_unsupported_object_is_refused_at_save(tmp_path: Path, value, key, typename) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        with pytest.raises(StateMismatchError) as e:
            mgr.save(1, {"w": torch.ones(2), **value})
        msg = str(e.value)
        assert repr(key) in msg and typename in msg and "pickle" in msg
        assert mgr.steps() == []
        # The manager is still usable.
        mgr.save(2, {"w": torch.ones(2)}).wait()
        assert mgr.steps() == [2]
    assert not (root / step_dir(1)).exists()


def test_invalid_options_raise_value_error(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with pytest.raises(ValueError, match=r"bogus.*exact"):
        CheckpointManager(root, per_rank="bogus")
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(root, keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointManager(root, keep_every=-1)
    with pytest.raises(ValueError, match="digest"):
        CheckpointManager(root, digest="md5")
    with pytest.raises(TypeError, match="no_such_option"):
        CheckpointManager(root, no_such_option=1)
    with CheckpointManager(root) as mgr:
        with pytest.raises(ValueError, match="step"):
            mgr.save(-1, tensor_state(0))
        with pytest.raises(ValueError, match="bogus"):
            mgr.restore(tensor_state(0), per_rank="bogus")
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(1, tensor_state(0))


@pytest.mark.parametrize("layout", ["fortran", "transposed"])
def test_restore_fills_a_non_contiguous_numpy_array(tmp_path: Path, layout: str) -> None:
    arr = np.arange(12, dtype=np.float64).reshape(3, 4) + 0.5
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"arr": arr}).wait()
        target = np.zeros((3, 4), order="F") if layout == "fortran" else np.zeros((4, 3)).T
        assert not target.flags["C_CONTIGUOUS"]
        state = {"arr": target}
        assert mgr.restore(state) == 1
    assert np.array_equal(state["arr"], arr), "restore returned success but left the array unchanged"


def test_small_targets_restore_through_the_byte_copy_or_copy_(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small overlaps read through a scratch buffer go into a target with one memmove when the
    target's memory is exactly the saved bytes; any other target (strided, another dtype,
    a negated view, a slice of the saved tensor) takes copy_. Both, bit for bit."""
    import shardkeeper.core.restore.fill as fill_mod

    g = torch.Generator().manual_seed(3)
    saved = {name: torch.randn(6, 5, generator=g) for name in ("plain", "param", "strided", "cast", "neg", "np")}
    saved["half"] = torch.randn(8, generator=g).to(torch.float16)
    moved: list[int] = []
    real = fill_mod._MEMMOVE
    monkeypatch.setattr(fill_mod, "_MEMMOVE", lambda d, s, n: (moved.append(n), real(d, s, n))[1])
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, saved).wait()
        np_target = np.zeros((6, 5), dtype=np.float32)
        target: dict[str, Any] = {
            "plain": torch.zeros(6, 5),
            "param": nn.Parameter(torch.zeros(6, 5)),
            "strided": torch.zeros(5, 6).t(),
            "cast": torch.zeros(6, 5, dtype=torch.float64),
            "neg": torch._neg_view(torch.zeros(6, 5)),
            "np": np_target,
            "half": torch.zeros(8, dtype=torch.float16),
        }
        assert mgr.restore(target, step=1, cast_dtypes=True) == 1
    for name in ("plain", "param", "strided", "half"):
        assert torch.equal(target[name].detach(), saved[name]), name
    assert torch.equal(target["cast"], saved["cast"].double())
    assert torch.equal(target["neg"], saved["neg"]) and target["neg"].is_neg()
    assert np.array_equal(np_target, saved["np"].numpy())
    # plain, param, np and half went through memmove; strided, cast and neg through copy_
    assert sorted(moved) == sorted([120, 120, 120, 16]), moved


@pytest.mark.parametrize("size", [6, 1 << 19], ids=["small", "direct-read"])
def test_restore_writes_without_torch_only_where_copy_would(tmp_path: Path, size: int) -> None:
    """Where restore writes a target's bytes itself (memmove from a scratch read, or a read
    straight into its memory), torch's bookkeeping holds as for copy_: the version counter
    moves (a backward through the old values fails loudly); zero tensors (no memory) and
    inference tensors go through copy_, which refuses them."""
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"w": torch.arange(size, dtype=torch.float32)}).wait()
        w = torch.zeros(size, requires_grad=True)
        loss = (w * w).sum()  # saves w for backward
        v0 = w._version
        mgr.restore({"w": w}, step=1)
        assert w._version > v0 and torch.equal(w.detach(), torch.arange(size, dtype=torch.float32))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        with pytest.raises(Exception, match="(?i)zerotensor|immutable"):
            mgr.restore({"w": torch._efficientzerotensor(size)}, step=1)  # a segfault before
        with torch.inference_mode():
            inf = torch.zeros(size)
        with pytest.raises(Exception, match="inference"):  # copy_'s own error (it has written by then)
            mgr.restore({"w": inf}, step=1)


def test_a_leaf_of_another_kind_in_the_target_is_refused_by_name(tmp_path: Path) -> None:
    """A tensor where the checkpoint holds bytes or a JSON value (or the other way round) is a
    changed structure: refused naming the key and both kinds, before anything is read."""
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        mgr.save(1, {"blob": b"abc", "cfg": {"lr": 0.1}, "w": torch.ones(2)}).wait()
        for target, key, kinds in (
            (
                {"blob": torch.zeros(3, dtype=torch.uint8), "cfg": {"lr": 0.0}, "w": torch.zeros(2)},
                "blob",
                "bytes leaf in the checkpoint but a tensor",
            ),
            (
                {"blob": b"", "cfg": {"lr": torch.zeros(1)}, "w": torch.zeros(2)},
                "cfg/lr",
                "object leaf in the checkpoint but a tensor",
            ),
        ):
            w = target["w"]
            with pytest.raises(StateMismatchError, match=rf"'{key}'.*{kinds}.*step 1|'{key}' in .*step 1.*{kinds}"):
                mgr.restore(target, step=1)
            assert not w.any()  # nothing was read


def test_what_save_accepts_restores_into_the_same_structure(tmp_path: Path) -> None:
    pair = (torch.ones(2), torch.full((3,), 2.0))
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        try:
            mgr.save(1, {"extra": {"pair": pair}}).wait()
        except StateMismatchError as e:  # refusing at save time is fine too: fail early
            assert "extra/pair" in str(e)
            return
        target = (torch.zeros(2), torch.zeros(3))
        mgr.restore({"extra": {"pair": target}})
    assert torch.equal(target[0], pair[0]) and torch.equal(target[1], pair[1])


# ------------------------------------------------------------------- 7. fenced commit


def test_second_writer_of_a_step_loses_and_cleans_up(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a, b = tensor_state(1), tensor_state(2)
    with CheckpointManager(str(root)) as m1, CheckpointManager(str(root)) as m2:
        m1.save(5, a).wait()
        winner = manifest_json(root, 5)
        winner_files = data_files(root, 5)
        assert winner_files == set(winner["files"])

        # The step is committed: refused by save() itself, before a byte is written (a
        # writer that commits while the save runs is the fenced commit's: tests/core/commit/test_fenced_race.py).
        with pytest.raises(CommitConflictError) as e:
            m2.save(5, b)
        assert isinstance(e.value, FileExistsError)
        assert "step 5 is already committed" in str(e.value) and str(root) in str(e.value)

        after = manifest_json(root, 5)
        assert after["attempt"] == winner["attempt"]
        assert after == winner
        # The loser's shard files are gone; only what the manifest references is left.
        assert data_files(root, 5) == winner_files
        referenced = {c["file"] for leaf in after["leaves"].values() for c in leaf.get("chunks", [])}
        assert referenced <= winner_files

        target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
        assert m2.restore(target) == 5
        assert torch.equal(target["w"], a["w"]) and target["meta"] == {"seed": 1}
        # The loser can go on with the next step.
        m2.save(6, b).wait()
        assert m2.steps() == [5, 6]


# ------------------------------------------------------------------ 8. partial restore


def test_partial_restore_reads_only_what_it_needs(storage_root) -> None:
    storage = storage_root.open()
    spy = SpyStorage(storage)
    opts = {"min_file_bytes": 256 << 10, "max_files_per_rank": 4}
    model, opt, sched = build(0, net=BigNet)
    train_step(model, opt, sched, 0)
    saved = params_of(model)
    with CheckpointManager(spy, **opts) as mgr:
        mgr.save(3, {"model": model, "optim": opt}).wait()

    manifest = json.loads(storage.read_bytes(f"{step_dir(3)}/manifest.json"))
    fc1_keys = ["model/fc1.weight", "model/fc1.bias"]
    fc1_chunks = [c for k in fc1_keys for c in manifest["leaves"][k]["chunks"]]
    fc1_files = {f"{step_dir(3)}/{c['file']}" for c in fc1_chunks}
    fc1_bytes = sum(c["length"] for c in fc1_chunks)
    all_files = {f"{step_dir(3)}/{f}" for f in manifest["files"]}
    assert len(all_files) > 1 and fc1_files < all_files, "test setup: fc1 should not span every file"

    target_model, target_opt, target_sched = build(1, net=BigNet)
    train_step(target_model, target_opt, target_sched, 5)
    before = params_of(target_model)
    before_opt = copy.deepcopy(target_opt.state_dict())
    spy.reads.clear()
    with CheckpointManager(spy, **opts) as mgr:
        assert mgr.restore({"model": target_model, "optim": target_opt}, only=["model/fc1.*"]) == 3
        stats = mgr.last_restore_stats
    assert stats is not None and stats.keys == 2

    want = {k: saved[k] if k.startswith("fc1.") else v for k, v in before.items()}
    assert_same_state(target_model.state_dict(), want, what="parameters (fc1 restored, the rest untouched)")
    assert_same_state(target_opt.state_dict(), before_opt, what="optimizer state")

    reads = spy.data_reads()
    assert reads, "nothing was read"
    assert {p for p, _ in reads} <= fc1_files, f"read files that hold no fc1 chunk: {reads}"
    read_bytes = sum(n for _, n in reads)
    assert read_bytes <= fc1_bytes, (read_bytes, fc1_bytes)
    assert stats.bytes_needed <= stats.bytes_read <= fc1_bytes
    # The big layers' weights alone are 2 MiB: a full read would show.
    assert read_bytes < 512 * 512 * 4 // 100


def test_partial_restore_with_a_prefix_pattern(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model, opt, sched = build(0)
    train_step(model, opt, sched, 0)
    saved = params_of(model)
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "progress": {"step": 1}}).wait()
        m2, o2, _ = build(1)
        before = params_of(m2)
        progress = {"step": 0}
        mgr.restore({"model": m2, "optim": o2, "progress": progress}, only="progress")
        assert progress == {"step": 1}
        assert_same_state(m2.state_dict(), before, what="parameters")
        mgr.restore({"model": m2, "optim": o2, "progress": progress}, only="model/*")
        assert_same_state(m2.state_dict(), saved, what="parameters")


# -------------------------------------------------------------------- 9. retention


def test_keep_last_through_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root), keep_last=2) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, tensor_state(s))
        mgr.wait()
        assert mgr.steps() == [3, 4]
        target = {"w": torch.zeros(3, 4), "meta": {"seed": -1}}
        assert mgr.restore(target, step=3) == 3 and target["meta"] == {"seed": 3}
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [step_dir(3), step_dir(4)]


def test_keep_every_with_keep_last(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(str(root), keep_last=1, keep_every=2) as mgr:
        for s in (1, 2, 3, 4, 5):
            mgr.save(s, tensor_state(s))
        mgr.wait()
        assert mgr.steps() == [2, 4, 5]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        step_dir(2),
        step_dir(4),
        step_dir(5),
    ]


# ----------------------------------------------------------------- 11. torch-free core


def test_ops_modules_import_without_torch() -> None:
    code = (
        "import shardkeeper.core, shardkeeper.core.cli, shardkeeper.core.commit.committed, "
        "shardkeeper.core.verify.step, shardkeeper.core.lifecycle.retention, shardkeeper.core.storage, "
        "shardkeeper.core.testing.faults, shardkeeper.core.format.manifest; import sys; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]


# ---------------------------------------------------------------- commit guards
class _LosesADataFileBeforeCommit(LocalStorage):
    """A gc racing a slow save: one shard file disappears after the writer closed it."""

    def sync_dir(self, path: str) -> None:
        super().sync_dir(path)
        if path.endswith("/data"):
            for name in self.list_dir(path):
                self.delete(f"{path}/{name}")
                break


def test_commit_refuses_a_manifest_over_a_missing_file(tmp_path: Path) -> None:
    with CheckpointManager(_LosesADataFileBeforeCommit(tmp_path)) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"missing at commit time.*gc"):
            mgr.save(1, tensor_state(0)).wait()
        assert mgr.steps() == []
    assert not (tmp_path / "step-000000000001" / "manifest.json").exists()


class _LostReplyOnCommit(LocalStorage):
    """An object store whose reply to the manifest PUT was lost: the retry finds it there."""

    def put_if_absent(self, path: str, data: bytes) -> None:
        super().put_if_absent(path, data)
        if path.endswith("manifest.json"):
            super().put_if_absent(path, data)  # the retry: raises CommitConflictError


def test_a_retried_commit_that_finds_its_own_manifest_succeeds(tmp_path: Path) -> None:
    state = tensor_state(0)
    with CheckpointManager(_LostReplyOnCommit(tmp_path)) as mgr:
        mgr.save(1, state).wait()
        assert mgr.steps() == [1]
    # and a different writer's manifest is still a conflict
    with CheckpointManager(tmp_path) as other:
        with pytest.raises(CommitConflictError):
            other.save(1, state).wait()


# -- manifest(), delete(), optional=, finalizers ---------------------------------------------


class _Counter:
    """A stateful object that records every load_state_dict it gets."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loads: list[dict] = []

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.loads.append(dict(sd))
        self.n = sd["n"]


def test_manifest_step_url_and_delete(tmp_path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step)), "meta": {"step": step}}, async_save=False)
        m = mgr.manifest()
        assert m.step == 3 and set(m.leaves) == {"w", "meta/step"}
        assert tuple(mgr.manifest(1).leaves["w"].shape) == (4,)
        assert mgr.step_url(2).endswith("step-000000000002")
        assert mgr.delete(2) is True and mgr.steps() == [1, 3]
        assert mgr.delete(3) is False and mgr.steps() == [1, 3]  # the newest is never deleted
        assert mgr.delete(7) is True  # not committed: gone already
        with pytest.raises(CheckpointNotFoundError):
            mgr.manifest(2)
        # A manifest that cannot be read: the step is neither deleted nor reported gone (it
        # was reported gone while it stayed, and a save at that step stayed refused).
        mgr.save(4, {"w": torch.zeros(4), "meta": {"step": 4}}, async_save=False)
        (tmp_path / "root" / "step-000000000001" / "manifest.json").write_text("{not json")
        assert mgr.steps() == [3, 4]
        assert mgr.delete(1) is False
        assert (tmp_path / "root" / "step-000000000001" / "manifest.json").exists()


def test_only_does_not_reload_objects_it_excluded_and_optional_keys_may_be_absent(tmp_path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"a": _Counter(5), "b": _Counter(6)}, async_save=False)
        a, b = _Counter(0), _Counter(0)
        mgr.restore({"a": a, "b": b}, only="a/*")
        assert (a.n, a.loads) == (5, [{"n": 5}])
        assert (b.n, b.loads) == (0, [])  # excluded: no load_state_dict with its own values
        c = _Counter(9)
        with pytest.raises(StateMismatchError, match="not in"):
            mgr.restore({"a": _Counter(0), "c": c})
        a2 = _Counter(0)
        mgr.restore({"a": a2, "c": c}, optional="c/*")
        assert a2.n == 5 and (c.n, c.loads) == (9, [])


def test_every_shape_and_dtype_mismatch_in_one_error(tmp_path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"a": torch.zeros(3), "b": torch.zeros(4), "c": torch.zeros(2)}, async_save=False)
        with pytest.raises(StateMismatchError) as info:
            mgr.restore({"a": torch.zeros(5), "b": torch.zeros(6), "c": torch.zeros(2)})
        msg = str(info.value)
        assert "2 key(s)" in msg and "'a'" in msg and "'b'" in msg and "'c'" not in msg
        assert "step 1" in msg and "rank 0" in msg and "only=" in msg
        with pytest.raises(StateMismatchError, match=r"2 key\(s\).*dtype.*cast_dtypes=True"):
            mgr.restore(
                {"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(2)}
            )


def test_restore_fills_views_of_leaves_that_require_grad(tmp_path) -> None:
    """Reads run on I/O threads, where the caller's no_grad does not reach."""
    big = torch.randn(1 << 19)  # 2 MiB: the direct-read path
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"w": big, "s": torch.arange(4.0)}, async_save=False)
        p = nn.Parameter(torch.zeros(1 << 19))
        q = nn.Parameter(torch.zeros(4))
        mgr.restore({"w": p.view(-1), "s": q[:]})
        assert torch.equal(p.detach(), big) and torch.equal(q.detach(), torch.arange(4.0))


def test_a_done_callback_hears_each_save_end_and_leaves_its_failure_to_wait(tmp_path: Path) -> None:
    """``SaveHandle.add_done_callback``: ``(step, None)`` once committed, ``(step, error)`` for a
    failure that ``wait()`` still raises; on an ended save it runs at once, in the caller."""
    heard: list[tuple[int, str | None, bool]] = []

    def hear(step: int, error: BaseException | None) -> None:
        heard.append((step, None if error is None else type(error).__name__, mgr.is_committed(step)))

    storage = FaultyStorage(LocalStorage(tmp_path / "r"), fail_on={"put_if_absent": "step-000000000002/manifest.json"})
    with CheckpointManager(storage) as mgr:
        h = mgr.save(1, {"w": torch.ones(2)}, async_save=True)
        h.add_done_callback(hear)
        h.wait()  # (the callback runs just after the waiters wake)
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard == [(1, None, True)]  # committed before the callback ran
        h.add_done_callback(hear)  # ended: at once, here
        assert heard[-1] == (1, None, True) and len(heard) == 2
        h = mgr.save(2, {"w": torch.ones(2)}, async_save=True)
        h.add_done_callback(hear)
        with pytest.raises(CheckpointSaveError, match="step 2"):
            h.wait()
        while len(heard) < 3 and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert heard[-1] == (2, "CheckpointSaveError", False)
        mgr.save(3, {"w": torch.ones(2)}, async_save=False)  # the failure was delivered by wait() alone
    assert mgr.is_committed(3)
