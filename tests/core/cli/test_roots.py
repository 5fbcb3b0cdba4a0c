"""The usual mistakes about ROOT (cli/roots.py): a step directory, or a path inside one, given
for the root, and a local root that is not there, exit 2 with the remedy, for every command
that reads a root."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage

try:
    from .._builders import age_everything, tensor, write_step
    from .._builders import run_cli as run
except ImportError:
    from _builders import age_everything, tensor, write_step
    from _builders import run_cli as run

READERS = (["ls"], ["inspect"], ["verify"], ["gc", "--dry-run"], ["advise", "--mtbf", "3h"])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    write_step(LocalStorage(root, fsync=False), 5, {"model/w": tensor("float32", (4, 4))})
    return root


@pytest.mark.parametrize("argv", READERS, ids=lambda a: a[0])
def test_a_step_directory_for_the_root(root: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    step = root / step_dir(5)
    assert step.is_dir()
    code, out, err = run(capsys, argv[0], step, *argv[1:])
    assert code == 2 and out == ""
    assert f"{step} is a step directory; the root is {root}" in err
    assert f"`shardkeeper {argv[0]} {root}`" in err
    assert len(err.strip().splitlines()) == 1
    # A path inside one (its data folder, its manifest) says the same.
    code, _, err = run(capsys, argv[0], step / "data", *argv[1:])
    assert code == 2 and f"inside the step directory {step_dir(5)}; the root is {root}" in err


def test_a_step_directory_of_an_object_store(capsys: pytest.CaptureFixture[str]) -> None:
    """Told by its name alone: nothing is opened (no credentials are needed to be told)."""
    code, _, err = run(capsys, "verify", f"s3://bucket/run/{step_dir(12)}/")
    assert code == 2 and "the root is s3://bucket/run" in err


@pytest.mark.parametrize("argv", READERS, ids=lambda a: a[0])
def test_a_missing_root(root: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    typo = root.parent / "rnu"
    code, out, err = run(capsys, argv[0], typo, *argv[1:])
    assert code == 2 and out == ""
    assert f"no such root: {typo}; did you mean {root}?" in err
    far = root.parent / "nowhere" / "deeper" / "run"
    code, _, err = run(capsys, argv[0], far, *argv[1:])
    assert code == 2 and f"no such root: {far} ({root.parent / 'nowhere'} does not exist either)" in err


def test_a_file_for_the_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    code, _, err = run(capsys, "ls", f)
    assert code == 2 and f"{f} is a file" in err


def test_a_root_named_like_a_step_is_still_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder that holds step directories is a root whatever its name."""
    odd = tmp_path / step_dir(7)
    write_step(LocalStorage(odd, fsync=False), 1, {"model/w": tensor("float32", (2, 2))})
    code, out, _ = run(capsys, "ls", odd)
    assert code == 0 and "committed" in out


def test_gc_on_a_real_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    age_everything(root)
    code, out, _ = run(capsys, "gc", root, "--dry-run")
    assert code == 0 and "gc: would remove 0 path(s)" in out


@pytest.mark.parametrize("argv", READERS, ids=lambda a: a[0])
def test_a_missing_bucket(s3_server: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bucket is there or not (a prefix holds nothing until written): a missing one is
    exit 2 naming it, as a missing local root is, not "no checkpoints" and exit 0."""
    url = "s3://sk-no-such-bucket/run"
    code, out, err = run(capsys, argv[0], url, *argv[1:], "-o", f"endpoint_url={s3_server}")
    assert code == 2 and out == "", (code, out, err)
    assert f"no such bucket: s3://sk-no-such-bucket (root {url})" in err and "endpoint" in err


def test_an_empty_root_in_a_bucket_lists_nothing(s3_root: tuple[str, dict], capsys: pytest.CaptureFixture[str]) -> None:
    url, options = s3_root
    endpoint = options["client_kwargs"]["endpoint_url"]
    code, out, err = run(capsys, "ls", url, "-o", f"endpoint_url={endpoint}")
    assert code == 0 and f"no checkpoints under {url}" in out + err, (code, out, err)
