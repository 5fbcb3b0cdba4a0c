"""Pointers are written once their step is committed: a run killed with a save in flight
leaves ``last.ckpt`` naming its last committed step, ``fit(ckpt_path="last")`` resumes from
there, and a pointer that names an uncommitted step (as earlier releases wrote them) resumes
from the newest committed step below it, with a warning naming both."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.pointer import pointer_document
from shardkeeper.core.testing.procs import kill_tree
from shardkeeper.lightning import ShardkeeperCheckpointIO, load_checkpoint
from shardkeeper.lightning.paths import write_pointer
from tests.checks import assert_same_state
from tests.exit_check import REPO
from tests.lightning.common import Net, cpu_trainer, loader

pytestmark = [pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parent / "dist" / "killed_save.py"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed (SIGKILL) while its save of step 4 was held before the commit: ``root``
    holds step 2 committed and step 4's data without a manifest; ``ck`` the pointers."""
    d = tmp_path_factory.mktemp("killed")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(d / "root"), str(d / "ck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(REPO),
        start_new_session=True,
    )
    out: list[str] = []
    held = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.strip() == "HELD":
                held.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert held.wait(180), "the save of step 4 was never held:\n" + "".join(out)[-6000:]
    finally:
        kill_tree(proc)  # SIGKILL, the save of step 4 in flight
        proc.wait(30)
        reader.join(30)
    assert proc.returncode == -9, "".join(out)[-6000:]
    return d


def _copy(killed: Path, to: Path) -> tuple[Path, Path]:
    shutil.copytree(killed / "root", to / "root")
    shutil.copytree(killed / "ck", to / "ck")
    return to / "root", to / "ck"


def _step(pointer: Path) -> int:
    return int(pointer_document(pointer.read_bytes())["step"])


class _Start(Callback):
    """The step and the weights a fit starts from (after its resume)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _resume(root: Path, ck: Path, tmp: Path) -> tuple[L.Trainer, _Start, Path]:
    """``fit(ckpt_path="last")``; the trainer, where it started, and its newest last path (a
    copied run's ModelCheckpoint versions it: ``last-v1.ckpt``)."""
    start = _Start()
    mc = ModelCheckpoint(dirpath=ck, every_n_train_steps=2, save_last=True)
    trainer = cpu_trainer(tmp, ShardkeeperCheckpointIO(root), callbacks=[mc, start])
    trainer.fit(Net(), loader(), ckpt_path="last")
    return trainer, start, Path(mc.last_model_path)


@pytest.mark.multiprocess  # the killed run is a process of its own: run one after another
def test_a_save_killed_before_its_commit_leaves_last_naming_the_committed_step(killed: Path, tmp_path: Path) -> None:
    root, ck = _copy(killed, tmp_path)
    assert (root / "step-000000000004").is_dir() and not (root / "step-000000000004" / "manifest.json").exists()
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]
    assert {_step(p) for p in ck.glob("*.ckpt")} == {2}  # last.ckpt and top-k: not the step in flight
    index = json.loads((root / "lightning-paths.json").read_text())
    assert set(index["paths"].values()) == {2}
    saved = load_checkpoint(root / "step-000000000002")["state_dict"]
    trainer, start, last = _resume(root, ck, tmp_path)
    assert start.step == 2
    assert_same_state(start.state, saved, what="the module resumed from last.ckpt")
    # the resumed run saves step 4 again over the killed attempt's files, and its pointers follow
    assert trainer.global_step == 8 and _step(last) == 8
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 8


@pytest.mark.multiprocess  # the killed run is a process of its own: run one after another
def test_a_pointer_to_an_uncommitted_step_resumes_below_it_with_a_warning(
    killed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, ck = _copy(killed, tmp_path)
    write_pointer(str(ck / "last.ckpt"), str(root), 4)  # what an earlier release left at the kill
    saved = load_checkpoint(root / "step-000000000002")["state_dict"]
    with caplog.at_level(logging.WARNING, logger="shardkeeper.lightning"):
        assert load_checkpoint(ck / "last.ckpt")["global_step"] == 2
        trainer, start, last = _resume(root, ck, tmp_path)
    warned = [r.getMessage() for r in caplog.records if "which is not committed" in r.getMessage()]
    assert len(warned) == 2 and all("names step 4" in w and "resuming from step 2" in w for w in warned)
    assert start.step == 2
    assert_same_state(start.state, saved, what="the module resumed below the uncommitted step")
    assert _step(last) == trainer.global_step == 8
    # nothing committed below it: an error naming the pointer, the step and the remedy
    other, ck2 = _copy(killed, tmp_path / "none")
    shutil.rmtree(other / "step-000000000002")
    write_pointer(str(ck2 / "last.ckpt"), str(other), 4)
    with pytest.raises(CheckpointNotFoundError, match=r"last\.ckpt names step 4 .*not committed.*no committed step"):
        _resume(other, ck2, tmp_path / "none")


class _Watch(Callback):
    """At step 5 (step 4's save issued, the next one not yet): wait for ``last.ckpt`` to name
    step 4, and check that it never named it before its commit."""

    def __init__(self, ck: Path, root: Path) -> None:
        self.ck, self.root, self.seen = ck, root, False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != 5:
            return
        last = self.ck / "last.ckpt"
        for _ in range(600):
            if _step(last) == 4:
                break
            threading.Event().wait(0.05)
        assert _step(last) == 4, "last.ckpt was not pointed at step 4 after its commit"
        assert (self.root / "step-000000000004" / "manifest.json").exists()
        self.seen = True


def test_after_a_commit_the_pointer_names_the_new_step(tmp_path: Path) -> None:
    """Written by the save's done-callback, without waiting for the next save or the end of fit."""
    root, ck = tmp_path / "root", tmp_path / "ck"
    watch = _Watch(ck, root)
    mc = ModelCheckpoint(dirpath=ck, every_n_train_steps=2, save_last=True)
    trainer = cpu_trainer(tmp_path, ShardkeeperCheckpointIO(root), callbacks=[mc, watch])
    trainer.fit(Net(), loader())
    assert watch.seen and _step(ck / "last.ckpt") == trainer.global_step == 8
    index = json.loads((root / "lightning-paths.json").read_text())
    assert set(index["paths"].values()) == {8}
