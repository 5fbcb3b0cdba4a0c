"""What a Lightning user's own tools make of the plugin's ``.ckpt`` pointers: ``torch.load``
(``weights_only=True``, torch's default) returns a message naming the root, the step and how
to load them, and using it as a state dict fails with that message, as does Lightning's own
loader (the plugin not installed); ``fit(ckpt_path=last.ckpt)`` with the plugin still resumes
bit for bit; ``shardkeeper ls`` of the ``ModelCheckpoint`` folder follows its pointers to the
root."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import shardkeeper.lightning as skl
from shardkeeper.core.cli import main
from tests.checks import assert_same_state
from tests.lightning.common import HNet, cpu_trainer, full_state, loader

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One epoch (step 8) saved through the plugin, ``ModelCheckpoint(save_last=True)``."""
    tmp = tmp_path_factory.mktemp("view")
    L.seed_everything(0)
    net = HNet(lr=0.01)
    t = cpu_trainer(
        tmp, skl.ShardkeeperCheckpointIO(tmp / "root"), callbacks=[ModelCheckpoint(tmp / "ck", save_last=True)]
    )
    t.fit(net, loader())
    return {
        "tmp": tmp,
        "root": tmp / "root",
        "last": tmp / "ck" / "last.ckpt",
        "step": t.global_step,
        "state": full_state(net, t.optimizers[0]),
    }


def test_torch_load_of_last_ckpt_names_its_root_and_step_and_fit_still_resumes(run: dict[str, Any]) -> None:
    last, root, step = run["last"], str(run["root"]), run["step"]
    got = torch.load(last, weights_only=True)
    assert got["root"] == root and got["step"] == step == 8
    message = got["shardkeeper_pointer"]
    assert message.startswith(
        f"This file is a shardkeeper pointer, not a torch checkpoint: its checkpoint is step {step} of the shardkeeper root {root}."
    )
    assert f".fit(model, ckpt_path={str(last)!r})" in message and f"load_checkpoint({str(last)!r})" in message
    assert torch.load(last, weights_only=False) == got
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"" + re.escape(message)):
        HNet().load_state_dict(torch.load(last)["state_dict"])
    # the same file resumes with the plugin, bit for bit: at the end of the saved epoch nothing
    # trains, and the state is the saved one
    net = HNet(lr=0.01)
    t = cpu_trainer(run["tmp"] / "resume", skl.ShardkeeperCheckpointIO(run["root"]))
    t.fit(net, loader(), ckpt_path=str(last))
    assert t.global_step == step
    assert_same_state(full_state(net, t.optimizers[0]), run["state"], what="fit(ckpt_path=last.ckpt)")


def test_lightnings_own_loader_fails_with_the_message(run: dict[str, Any], tmp_path: Path) -> None:
    """The plugin not installed (``uninstall()``, or a script that never imports it)."""
    skl.uninstall()
    try:
        for load in (
            lambda: HNet.load_from_checkpoint(run["last"]),
            lambda: cpu_trainer(tmp_path, epochs=2).fit(HNet(lr=0.01), loader(), ckpt_path=str(run["last"])),
        ):
            with pytest.raises(
                RuntimeError,
                match=rf"This file is a shardkeeper pointer.*step 8 of the shardkeeper root {re.escape(str(run['root']))}",
            ):
                load()
    finally:
        skl.install()


def test_shardkeeper_ls_of_the_checkpoint_folder_follows_its_pointers(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    ck, root = run["tmp"] / "ck", run["root"]
    for given in (ck, run["last"]):
        assert main(["ls", str(given)]) == 0
        out, err = capsys.readouterr()
        assert "no checkpoints" not in out + err
        assert f"to root {root}" in err and [line.split()[0] for line in out.splitlines()[1:]] == ["8"]
