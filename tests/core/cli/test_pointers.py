"""A pointer file (the core's format, ``shardkeeper.core.format.pointer``: what an adapter
leaves where its framework expects a checkpoint file) loads in ``torch.load`` as a message
naming its root and step, is read by shardkeeper without unpickling, and leads the CLI to its
root: a pointer, a folder of pointers or a folder whose subfolder is the root is followed
(said on stderr), a folder leading to several roots names them."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointError, CheckpointManager
from shardkeeper.core.format.pointer import (
    MEMBER,
    PointerDamagedError,
    encode_pointer,
    looks_like_pointer,
    pointer_document,
    pointer_message,
)

try:
    from .._builders import run_cli
except ImportError:
    from _builders import run_cli

pytestmark = [pytest.mark.timeout(60)]
FORMAT = "shardkeeper-lightning-pointer"


def _root(path: Path, *steps: int) -> Path:
    with CheckpointManager(str(path)) as mgr:
        for s in steps:
            mgr.save(s, {"w": torch.arange(4.0) + s}, async_save=False)
    return path


def _pointer(path: Path, root: Path | str, step: int) -> Path:
    doc = {"format": FORMAT, "version": 1, "root": str(root), "step": step}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_pointer(doc, pointer_message(str(root), step, "Load it with X."), {"extra": "e"}))
    return path


def test_torch_load_of_a_pointer_says_what_it_is_and_where_its_checkpoint_is(tmp_path: Path) -> None:
    p = _pointer(tmp_path / "last.ckpt", "/data/run", 2**40)  # a step past 2**31 too
    for weights_only in (True, False):
        got = torch.load(p, weights_only=weights_only)
        assert got["root"] == "/data/run" and got["step"] == 2**40 and got["format"] == FORMAT
        assert got["extra"] == "e"
        message = got["shardkeeper_pointer"]
        assert message.startswith("This file is a shardkeeper pointer, not a torch checkpoint")
        assert "step 1099511627776 of the shardkeeper root /data/run. Load it with X." in message
    with pytest.raises(RuntimeError, match="Unexpected key.*This file is a shardkeeper pointer.*root /data/run"):
        torch.nn.Linear(2, 2).load_state_dict(torch.load(p)["state_dict"])
    # shardkeeper reads the JSON member only, first in the zip: the file's first bytes show it
    data = p.read_bytes()
    assert looks_like_pointer(data) and data.index(b'"root": "/data/run"') < 200
    assert pointer_document(data) == {"format": FORMAT, "version": 1, "root": "/data/run", "step": 2**40}
    real = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, real)  # a torch checkpoint is no pointer
    assert not looks_like_pointer(real.getvalue()) and not looks_like_pointer(b"\x80\x02}q\x00.")
    with pytest.raises(PointerDamagedError, match=r"starts like one \(a zip\) but does not read"):
        pointer_document(data[: len(data) // 2])
    garbage = io.BytesIO()
    with zipfile.ZipFile(garbage, "w") as z:
        z.writestr(MEMBER, b"{not json")
    with pytest.raises(PointerDamagedError, match="its JSON does not parse"):
        pointer_document(garbage.getvalue())
    assert pointer_document(json.dumps({"format": FORMAT}).encode()) == {"format": FORMAT}  # the bare-JSON form


@pytest.mark.parametrize("form", ["zip", "bare-json"])
def test_ls_follows_a_pointer_to_its_root(tmp_path: Path, form: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path / "root", 3, 5)
    last = tmp_path / "ckpts" / "last.ckpt"
    if form == "zip":
        _pointer(last, root, 5)
    else:  # the form pointers had before the zip
        last.parent.mkdir()
        last.write_text(json.dumps({"format": FORMAT, "version": 1, "root": str(root), "step": 5}))
    code, out, err = run_cli(capsys, "ls", last)
    assert code == 0, err
    assert f"following pointer {last} to root {root} (step 5)" in err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["3", "5"]
    # STEP left out: the pointer's own step (not the newest)
    _pointer(tmp_path / "ckpts" / "epoch=0-step=3.ckpt", root, 3)
    code, out, err = run_cli(capsys, "inspect", tmp_path / "ckpts" / "epoch=0-step=3.ckpt", "--json")
    assert code == 0 and json.loads(out)["step"] == 3 and "following pointer" in err
    code, out, _ = run_cli(capsys, "verify", last, "3")  # STEP given: that step
    assert code == 0 and "step 3" in out and "step 5" not in out


def test_ls_follows_a_folder_of_pointers_or_a_project_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _root(tmp_path / "run" / "root", 3, 5)
    ckpts = tmp_path / "run" / "ckpts"
    _pointer(ckpts / "last.ckpt", root, 5)
    _pointer(ckpts / "epoch=0-step=3.ckpt", root, 3)
    (ckpts / "notes.txt").write_text("x")  # other files are no pointers
    code, out, err = run_cli(capsys, "ls", ckpts)
    assert code == 0 and "no checkpoints" not in out + err
    assert (
        f"following {ckpts} to root {root} (it holds no step-* directories; pointer epoch=0-step=3.ckpt: step 3, pointer last.ckpt: step 5)"
        in err
    )
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["3", "5"]
    # a project folder whose subfolder is the root (Accelerate's project_dir/checkpoints)
    project = tmp_path / "proj"
    _root(project / "checkpoints", 7)
    (project / "logs").mkdir()
    code, out, err = run_cli(capsys, "ls", project)
    assert code == 0 and f"following {project} to root {project / 'checkpoints'}" in err
    assert out.splitlines()[1].split()[0] == "7"


def test_a_folder_leading_to_several_roots_names_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _root(tmp_path / "a", 1), _root(tmp_path / "b", 2)
    ckpts = tmp_path / "ckpts"
    _pointer(ckpts / "last.ckpt", a, 1)
    _pointer(ckpts / "other.ckpt", b, 2)
    code, out, err = run_cli(capsys, "ls", ckpts)
    assert code == 2 and out == ""
    assert f"{ckpts} is not a checkpoint root (it holds no step-* directories) and leads to 2 roots" in err
    assert f"{a} (pointer last.ckpt: step 1); {b} (pointer other.ckpt: step 2)" in err
    assert f"`shardkeeper ls {a}`" in err
    code, _, err = run_cli(capsys, "ls", tmp_path)  # the folders a and b themselves
    assert code == 2 and f"leads to 2 roots: {a} (its folder a holds step-* directories)" in err


def test_what_is_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path / "root", 1)
    gone = _pointer(tmp_path / "gone.ckpt", tmp_path / "moved-away", 4)
    code, _, err = run_cli(capsys, "ls", gone)
    assert code == 2 and f"no such root: {tmp_path / 'moved-away'} (named by the pointer {gone})" in err
    last = _pointer(tmp_path / "last.ckpt", root, 1)
    code, _, err = run_cli(capsys, "import", tmp_path / "src", last, "--step", "2")  # a root to create: not followed
    assert code == 2 and f"{last} is a shardkeeper pointer file naming step 1 of the root {root}" in err
    empty = tmp_path / "empty-root"
    empty.mkdir()
    (empty / "LATEST").write_text("3")  # a root whose steps are gone leads nowhere else
    _root(empty / "sub", 1)
    code, out, err = run_cli(capsys, "ls", empty)
    assert code == 0 and "following" not in err and f"no checkpoints under {empty}" in out + err


def test_the_manager_names_a_pointers_root(tmp_path: Path) -> None:
    root = _root(tmp_path / "root", 5)
    last = _pointer(tmp_path / "last.ckpt", root, 5)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(str(last))
    assert f"{last} is a shardkeeper pointer file naming step 5 of the root {root}" in str(e.value)
