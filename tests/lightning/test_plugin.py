"""In-process tests (one device, no process group): codec, paths, retention, errors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.pointer import pointer_document
from shardkeeper.lightning import ShardkeeperCheckpointIO, codec
from tests.checks import assert_same_state
from tests.lightning.common import Net, loader


def _trainer(plugin: ShardkeeperCheckpointIO, epochs: int, *callbacks: object) -> L.Trainer:
    return L.Trainer(
        default_root_dir=os.path.dirname(plugin.root),
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def test_codec_roundtrips_what_json_cannot_hold(tmp_path: Path) -> None:
    value = {
        "a/b": 1,
        "50%": 2,
        "#x": 3,
        "__seq__": "not a marker",
        7: "int key",
        "inf": math.inf,
        "ninf": -math.inf,
        "pair": (torch.arange(3), "s"),
        "lst": [torch.ones(2)],
        "plain": (1, 2),
        "t": torch.tensor(2.5),
        "empty": {},
        "none": None,
    }
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, {"extra": codec.encode(value)}, async_save=False)
        sk = {"extra": codec.skeleton(mgr.manifest(1).leaves, "extra")}
        mgr.restore(sk, step=1)
    got = codec.decode(sk["extra"])
    assert set(got) == set(value)
    assert got["a/b"] == 1 and got["50%"] == 2 and got["#x"] == 3 and got[7] == "int key"
    assert got["__seq__"] == "not a marker" and got["inf"] == math.inf and got["ninf"] == -math.inf
    assert isinstance(got["pair"], tuple) and torch.equal(got["pair"][0], torch.arange(3)) and got["pair"][1] == "s"
    assert isinstance(got["lst"], list) and torch.equal(got["lst"][0], torch.ones(2))
    assert (
        got["plain"] == [1, 2]
        and torch.equal(got["t"], torch.tensor(2.5))
        and got["empty"] == {}
        and got["none"] is None
    )
    with pytest.raises(TypeError, match="cannot store without pickling"):
        codec.encode({"k": object()})


def test_retention_follows_model_checkpoint_top_k_and_last(tmp_path: Path) -> None:
    L.seed_everything(0)
    plugin = ShardkeeperCheckpointIO(tmp_path / "root")
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="train_loss", save_top_k=2, save_last=True)
    t = _trainer(plugin, 5, mc)
    t.fit(Net(), loader())
    pointers = {f: pointer_document((tmp_path / "ck" / f).read_bytes())["step"] for f in os.listdir(tmp_path / "ck")}
    assert len(pointers) == 3 and "last.ckpt" in pointers  # top 2 + last
    assert plugin.steps() == sorted(set(pointers.values()))  # every other step was deleted
    assert max(plugin.steps()) == t.global_step  # the newest is kept
    index = json.loads((tmp_path / "root" / "lightning-paths.json").read_text())
    assert sorted(index["paths"].values()) == sorted(pointers.values()) and index["orphans"] == []
    # Removing every path of the newest step never deletes it (the newest committed step).
    for f, s in pointers.items():
        if s == t.global_step:
            t.strategy.remove_checkpoint(str(tmp_path / "ck" / f))
    assert t.global_step in plugin.steps()


def test_removing_a_file_that_is_not_a_pointer_removes_it_as_lightning_would(tmp_path: Path) -> None:
    """A file the strategy removes that is not one of the plugin's pointers (a plain .ckpt of an
    earlier run beside them) is removed as TorchCheckpointIO removes it; the strategy's removal
    went through the plugin back into itself before (RecursionError)."""
    plugin = ShardkeeperCheckpointIO(tmp_path / "root")
    t = _trainer(plugin, 1, ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True))
    t.fit(Net(), loader())
    steps = plugin.steps()
    foreign = tmp_path / "ck" / "from-an-earlier-run.ckpt"
    torch.save({"state_dict": {}}, foreign)
    t.strategy.remove_checkpoint(str(foreign))
    assert not foreign.exists() and (tmp_path / "ck" / "last.ckpt").exists()
    assert plugin.steps() == steps  # nothing of the root touched


def test_save_twice_at_one_step_writes_once_and_resume_from_root(tmp_path: Path) -> None:
    L.seed_everything(0)
    plugin = ShardkeeperCheckpointIO(tmp_path / "root")
    net = Net()
    t = _trainer(plugin, 1)
    t.fit(net, loader())
    t.save_checkpoint(tmp_path / "a.ckpt")
    t.save_checkpoint(tmp_path / "b.ckpt")  # same global_step: another name for the same step
    assert plugin.steps() == [t.global_step]
    assert pointer_document((tmp_path / "a.ckpt").read_bytes())["step"] == t.global_step  # a pointer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    L.seed_everything(1)
    net2 = Net()
    t2 = _trainer(ShardkeeperCheckpointIO(tmp_path / "root2"), 1)
    t2.fit(net2, loader(), ckpt_path=str(tmp_path / "root"))  # the root: its newest step
    assert t2.global_step == t.global_step  # nothing left to train: max_epochs reached
    assert_same_state(net2.state_dict(), before, what="the module resumed from the root")


def test_clear_errors_for_paths_that_are_not_ours(tmp_path: Path) -> None:
    legacy = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}}, legacy)
    t = _trainer(ShardkeeperCheckpointIO(tmp_path / "root"), 1)
    with pytest.raises(CheckpointNotFoundError, match="import_lightning_checkpoint"):
        t.fit(Net(), loader(), ckpt_path=str(legacy))
    t = _trainer(ShardkeeperCheckpointIO(tmp_path / "root"), 1)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        t.fit(Net(), loader(), ckpt_path=str(tmp_path / "missing.ckpt"))
    t = _trainer(ShardkeeperCheckpointIO(tmp_path / "root"), 1)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        t.fit(Net(), loader(), ckpt_path=str(tmp_path / "root"))


def test_import_refuses_pickles_without_opt_in_and_directories(tmp_path: Path) -> None:
    from shardkeeper.lightning import import_lightning_checkpoint

    src = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, src)
    with pytest.raises(PermissionError, match="trust_pickle=True"):
        import_lightning_checkpoint(src, tmp_path / "root")
    assert not (tmp_path / "root").exists()
    with pytest.raises(NotImplementedError, match="directory"):
        import_lightning_checkpoint(tmp_path, tmp_path / "root", trust_pickle=True)
    sharded = tmp_path / "sharded.ckpt"  # the refusal comes before anything is opened
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"not read")
    with pytest.raises(PermissionError, match="sharded Lightning checkpoint.*trust_pickle=True"):
        import_lightning_checkpoint(sharded, tmp_path / "root")
    assert not (tmp_path / "root").exists()
    with pytest.warns(UserWarning, match="unpickling"):
        assert import_lightning_checkpoint(src, tmp_path / "root", trust_pickle=True) == 3
    with CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.steps() == [3] and "model/w" in mgr.manifest(3).leaves
