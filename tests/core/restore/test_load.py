"""``CheckpointManager.load()``: a committed step into a new nested dict, without a target.

A step saved by two ranks with every tensor sharded (FSDP2, TP), raw and compressed plus
encrypted, is loaded in one process and compared bit for bit with the full tensors the
ranks gathered at save time; JSON values, bytes and per-rank entries come back as saved.
Single-process tests cover the nested shape, ``only=``, the memory bound, a missing step and
an encrypted step without its key.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkeeper.core import (
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    EncryptionKeyError,
    PerRank,
)
from tests.checks import assert_same_state, flatten

from .._launch import run_workers

KEY = base64.b64encode(bytes(range(32))).decode()
NAMES = ("fsdp2-raw", "fsdp2-zstd-enc", "tp-raw", "tp-zstd-enc")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load")
    res = run_workers(2, "load_worker.py", str(root), timeout_s=240, env={"SK_LOAD_KEY": KEY})
    assert res.returncode == 0, res.stdout[-6000:]
    return root


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_load_assembles_every_ranks_shards_bit_for_bit(saved: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SK_LOAD_KEY", KEY)
    ref = torch.load(saved / f"{name}.ref.pt", weights_only=True)
    encryption = "env:SK_LOAD_KEY" if name.endswith("enc") else None
    with CheckpointManager(saved / name, encryption=encryption) as mgr:
        assert mgr.manifest().world_size == 2
        got = mgr.load()
    assert_same_state(got, ref, what=f"load() of {name}", subset=True)
    tensors = {k for k in flatten(got) if k.startswith(("model/", "optim/state/"))}
    assert tensors == set(ref)  # every parameter and optimizer tensor, nothing more
    assert got["model"]["big.weight"].shape == (1536, 512)  # full, not a shard
    assert got["half"].dtype == torch.bfloat16 and torch.equal(
        got["half"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    )
    assert got["meta"] == {"step": 2, "layout": name.split("-")[0], "lr": [0.1, 0.01]}
    assert got["blob"] == bytes(range(256)) * 3
    assert got["note"] == {"0": {"rank": 0}, "1": {"rank": 1}}  # one entry per saving rank
    assert set(got["rng"]) == {"0", "1"} and got["rng"]["0"]["torch"].dtype == torch.uint8
    assert isinstance(got["optim"]["param_groups"], list)
    assert (saved / f"{name}.lone-ok").exists()  # rank 1 loaded it alone inside the live group


def test_process_group_names_only_local(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "r", process_group="local") as mgr:
        assert (mgr.rank, mgr.world_size) == (0, 1)
    with pytest.raises(ValueError, match="'local'"):
        CheckpointManager(tmp_path / "r", process_group="world")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_load_of_an_encrypted_step_needs_its_key(saved: Path) -> None:
    with CheckpointManager(saved / "tp-zstd-enc") as mgr, pytest.raises(EncryptionKeyError, match="encryption="):
        mgr.load()


# -- one process -------------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": nn.Linear(4, 3),
        "extra": {"ints": torch.arange(5, dtype=torch.int16), "nested": {"x": torch.ones(2, 2)}},
        "seq": [torch.zeros(3), torch.full((2,), 7.0)],
        "meta": {"epoch": 3, "name": "run", "ok": True, "none": None},
        "blob": b"\x00\x01binary",
        "empty": {},
        "counter": PerRank({"seen": 11}),
    }


def test_load_returns_the_state_nested_as_it_was_given(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(5, state)
        got = mgr.load()
        assert mgr.load(5).keys() == got.keys()
    assert set(got) == {"model", "extra", "seq", "meta", "blob", "empty", "counter"}
    assert torch.equal(got["model"]["weight"], state["model"].weight.detach())
    assert torch.equal(got["model"]["bias"], state["model"].bias.detach())
    assert got["extra"]["ints"].dtype == torch.int16 and torch.equal(got["extra"]["ints"], torch.arange(5).short())
    assert torch.equal(got["extra"]["nested"]["x"], torch.ones(2, 2))
    assert set(got["seq"]) == {"0", "1"} and torch.equal(got["seq"]["1"], torch.full((2,), 7.0))
    assert got["meta"] == {"epoch": 3, "name": "run", "ok": True, "none": None}
    assert got["blob"] == b"\x00\x01binary" and isinstance(got["blob"], bytes)
    assert got["empty"] == {}
    assert got["counter"] == {"0": {"seen": 11}}
    assert got["model"]["weight"].device.type == "cpu"
    got["model"]["weight"].add_(1)  # a new tensor: the saved state is not touched
    assert not torch.equal(got["model"]["weight"], state["model"].weight.detach())


def test_load_only_selects_by_pattern(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state())
        assert set(mgr.load(only="model/*")) == {"model"}
        got = mgr.load(only=["extra/nested", "meta/epoch"])
        assert set(flatten(got)) == {"extra/nested/x", "meta/epoch"}
        with pytest.raises(CheckpointRestoreError, match=r"only=\['nope/\*'\] matches no key of step 1"):
            mgr.load(only="nope/*")


def test_load_refuses_more_than_max_bytes_up_front(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, {"a": torch.zeros(100, dtype=torch.float32), "b": torch.zeros(10, dtype=torch.int8)})
        with pytest.raises(CheckpointRestoreError) as e:
            mgr.load(max_bytes=409)
        text = str(e.value)
        assert "step 3 under" in text and str(tmp_path) in text
        assert "410 bytes" in text and "max_bytes=409" in text and "only=" in text
        assert "a (400 B)" in text
        assert set(mgr.load(max_bytes=410)) == {"a", "b"}
        assert set(mgr.load(only="a", max_bytes=400)) == {"a"}
        with pytest.raises(ValueError, match="max_bytes must be an int"):
            mgr.load(max_bytes=-1)


def test_load_of_a_missing_step_names_root_and_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CheckpointNotFoundError, match=re.escape(f"no committed checkpoint under {tmp_path}")):
            mgr.load()
        mgr.save(1, {"x": torch.ones(1)})
        with pytest.raises(CheckpointNotFoundError, match="step 2 is not committed under"):
            mgr.load(2)
        with pytest.raises(TypeError, match=r"load\(\): step must be an int >= 0 or None, got str"):
            mgr.load("1")  # type: ignore[arg-type]


def test_load_waits_for_the_pending_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:  # async: load() waits for the save in flight
        mgr.save(4, {"x": torch.arange(3)})
        assert torch.equal(mgr.load(4)["x"], torch.arange(3))


@pytest.mark.parametrize(
    "state",
    [
        {"extra": {"lr": 0.1, "lr/warmup": torch.ones(3)}},  # a JSON value at a tensor's prefix
        {"m": {"w": torch.zeros(2), "w/b": torch.ones(2)}},  # a tensor at a tensor's prefix
    ],
)
def test_load_refuses_keys_that_cannot_nest_instead_of_dropping_one(tmp_path: Path, state: dict[str, Any]) -> None:
    """A dict key holding '/' saves a key under another key: load() says so and reads nothing;
    it never drops one of them nor calls the step damaged. restore() into the target reads both."""
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, state)
        with pytest.raises(CheckpointRestoreError, match=r"holds both .*restore\(state, step=3\)") as info:
            mgr.load()
        assert "damaged" not in str(info.value)
        target = {
            k: ({kk: (v.clone().zero_() if isinstance(v, torch.Tensor) else v) for kk, v in d.items()})
            for k, d in state.items()
        }
        mgr.restore(target, step=3)
    for k, d in state.items():
        for kk, v in d.items():
            assert torch.equal(target[k][kk], v) if isinstance(v, torch.Tensor) else target[k][kk] == v
