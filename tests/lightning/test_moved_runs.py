"""A run directory moved or copied whole (root and pointers inside it) still resumes from its
``last.ckpt``: a pointer names its root absolutely and relative to itself, the absolute one
first; a pointer written before the relative name finds the root by its last path
components beside it; a root that is really gone fails naming the pointer, root and step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.pointer import pointer_document
from shardkeeper.lightning import ShardkeeperCheckpointIO
from tests.checks import assert_same_state
from tests.lightning.common import HNet, full_state, loader


def _trainer(run: Path, epochs: int) -> L.Trainer:
    return L.Trainer(
        default_root_dir=str(run),
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[ShardkeeperCheckpointIO(run / "root")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=run / "ckpts", save_last=True)],
    )


def _train(run: Path) -> dict[str, Any]:
    L.seed_everything(0)
    net = HNet(lr=0.02)
    t = _trainer(run, 2)
    t.fit(net, loader())
    return {"state": full_state(net, t.optimizers[0]), "step": t.global_step}


def _resume(run: Path, pointer: Path) -> tuple[L.Trainer, HNet]:
    L.seed_everything(3)  # another init: everything must come from the checkpoint
    net = HNet(lr=0.02)
    t = _trainer(run, 2)  # max_epochs reached: the resumed state is the final one
    t.fit(net, loader(), ckpt_path=str(pointer))
    return t, net


def test_a_moved_run_resumes_and_loads_from_its_last_ckpt(tmp_path: Path) -> None:
    before = _train(tmp_path / "run")
    doc = pointer_document((tmp_path / "run" / "ckpts" / "last.ckpt").read_bytes())
    assert doc["root_relative"] == "../root" and doc["root"] == str(tmp_path / "run" / "root")
    moved = tmp_path / "elsewhere" / "run-moved"
    shutil.move(str(tmp_path / "run"), str(moved))
    assert not (tmp_path / "run").exists()
    t, net = _resume(moved, moved / "ckpts" / "last.ckpt")
    assert t.global_step == before["step"]
    assert_same_state(full_state(net, t.optimizers[0]), before["state"], what="resumed from the moved last.ckpt")
    lm = HNet.load_from_checkpoint(moved / "ckpts" / "last.ckpt")
    assert lm.hparams.lr == 0.02
    assert_same_state(
        {f"model/{k}": v for k, v in lm.state_dict().items()},
        {k: v for k, v in before["state"].items() if k.startswith("model/")},
        what="load_from_checkpoint(moved last.ckpt)",
    )
    # the moved run goes on saving into its moved root, and its new pointers name it
    t3 = _trainer(moved, 3)
    t3.fit(HNet(lr=0.02), loader(), ckpt_path=str(moved / "ckpts" / "last.ckpt"))
    newest = pointer_document(Path(t3.checkpoint_callback.last_model_path).read_bytes())  # type: ignore[union-attr]
    assert newest["root"] == str(moved / "root") and newest["step"] == t3.global_step > before["step"]


def test_an_older_pointer_finds_the_moved_root_by_its_name(tmp_path: Path) -> None:
    before = _train(tmp_path / "run")
    last = tmp_path / "run" / "ckpts" / "last.ckpt"
    doc = pointer_document(last.read_bytes())
    del doc["root_relative"]  # a pointer written before root_relative existed (bare JSON then)
    last.write_text(json.dumps(doc))
    moved = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", moved)
    shutil.rmtree(tmp_path / "run")
    t, net = _resume(moved, moved / "ckpts" / "last.ckpt")
    assert_same_state(full_state(net, t.optimizers[0]), before["state"], what="resumed from an older pointer")


def test_a_root_that_is_really_gone_is_a_clear_error(tmp_path: Path) -> None:
    before = _train(tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "run" / "ckpts", moved / "ckpts")  # the pointers without their root
    shutil.rmtree(tmp_path / "run")
    step = before["step"]
    with pytest.raises(
        CheckpointNotFoundError,
        match=rf"last\.ckpt names step {step} under root {tmp_path / 'run' / 'root'}, which does not exist.*"
        rf"Copy or move the root back.*ckpt_path='<root>/step-{step:012d}'",
    ):
        _resume(moved, moved / "ckpts" / "last.ckpt")
