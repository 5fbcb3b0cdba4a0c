"""The manager knows the usual mistakes about a root as the CLI does (``root_check``): a step
directory, a path inside one, a pointer file or a file of a root is refused naming the real
root (and step); a root whose parent does not exist either and is a near miss of an existing
folder warns (a typo'd path would otherwise start a fresh run silently); a new run's or a new
project's folders do not."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointError, CheckpointManager, step_dir

try:
    from .._builders import run_cli
except ImportError:
    from _builders import run_cli

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(5, {"w": torch.arange(4.0)}, async_save=False)
    return root


def _pointer(path: Path, root: Path, step: int) -> Path:
    """A pointer file as the Lightning adapter writes one (``last.ckpt``)."""
    doc = {"format": "shardkeeper-lightning-pointer", "version": 1, "root": str(root), "step": step}
    path.write_text(json.dumps(doc))
    return path


def test_a_step_directory_or_a_pointer_for_the_root_names_the_root(root: Path, tmp_path: Path) -> None:
    step = root / step_dir(5)
    for given, what in ((step, "a step directory"), (step / "data", f"inside the step directory {step_dir(5)}")):
        with pytest.raises(CheckpointError) as e:
            CheckpointManager(str(given))
        assert f"{given} is {what}; the root is {root}" in str(e.value)
        assert f"CheckpointManager({str(root)!r}), and restore(state, step=5)" in str(e.value)
    with pytest.raises(CheckpointError, match=r"the root is s3://bucket/run .*CheckpointManager\('s3://bucket/run'\)"):
        CheckpointManager(f"s3://bucket/run/{step_dir(12)}/")  # told by its name: nothing is opened
    last = _pointer(tmp_path / "last.ckpt", root, 5)
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(str(last))
    assert f"{last} is a shardkeeper pointer file naming step 5 of the root {root}" in str(e.value)
    assert f"CheckpointManager({str(root)!r}), and restore(state, step=5)" in str(e.value)
    with pytest.raises(CheckpointError, match=rf"LATEST is a file of the root {root}: CheckpointManager"):
        CheckpointManager(str(root / "LATEST"))
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    with pytest.raises(CheckpointError, match="is a file; a checkpoint root is the folder"):
        CheckpointManager(str(notes))
    odd = tmp_path / step_dir(7)  # a folder that holds step directories is a root, whatever its name
    root.rename(odd)
    with CheckpointManager(str(odd)) as mgr:
        assert mgr.steps() == [5]


def test_a_root_whose_parent_is_a_typo_warns(root: Path, tmp_path: Path) -> None:
    typo = tmp_path / "rnu" / "ckpt"
    with pytest.warns(
        UserWarning, match=rf"the root {typo} does not exist, nor does {tmp_path / 'rnu'}: did you mean {root}\?"
    ):
        CheckpointManager(str(typo)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointManager(str(tmp_path / "run-2")).close()  # a new run's folder: no warning
        CheckpointManager(str(tmp_path / "project" / "checkpoints")).close()  # a new project's
        CheckpointManager(str(root)).close()


def test_the_cli_follows_a_pointer_to_its_root(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = _pointer(tmp_path / "last.ckpt", root, 5)
    code, out, err = run_cli(capsys, "ls", last)  # followed (tests/core/cli/test_pointers.py)
    assert code == 0 and out.splitlines()[1].split()[0] == "5"
    assert f"following pointer {last} to root {root} (step 5)" in err
    code, _, err = run_cli(capsys, "verify", root / "LATEST")
    assert code == 2 and f"is a file of the root {root}: `shardkeeper verify {root}`" in err
