"""Deleting a damaged step, the newest one included: ``CheckpointManager.delete(step,
damaged=True)`` and ``shardkeeper delete ROOT STEP [--damaged]``.

Retention never deletes the newest committed step, and a save at or below it is refused, so
a run whose newest step is damaged had no tool to save there again. The step is verified
first and deleted only when it is damaged; an intact one, or one the storage could not be
asked about, is refused with nothing deleted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.committed import committed_steps, manifest_path
from shardkeeper.core.errors import StorageError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from tests.checks import assert_same_state
from tests.core._builders import run_cli

pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(32, generator=g)}


def _flip(root: Path, step: int, key: str = "a") -> None:
    """Flip one byte inside ``key``'s chunk of ``step``."""
    leaf = json.loads((root / step_dir(step) / "manifest.json").read_bytes())["leaves"][key]
    c = leaf["chunks"][0]
    path = root / step_dir(step) / c["file"]
    raw = bytearray(path.read_bytes())
    raw[c["offset"] + c["length"] // 2] ^= 0x20
    path.write_bytes(bytes(raw))


def _two_steps(root: Path, **opts: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    s1, s2 = _state(1), _state(2)
    with CheckpointManager(root, async_save=False, **opts) as mgr:
        mgr.save(1, s1)
        mgr.save(2, s2)
    return s1, s2


def test_a_damaged_newest_step_is_deleted_and_its_step_can_be_saved_again(tmp_path: Path) -> None:
    s1, _ = _two_steps(tmp_path)
    _flip(tmp_path, 2)
    with CheckpointManager(tmp_path) as mgr:
        assert not mgr.delete(2), "retention's delete() keeps the newest step"
        assert mgr.delete(2, damaged=True)
        assert mgr.steps() == [1] and not (tmp_path / step_dir(2)).exists()
        target = _state(9)
        assert mgr.restore(target) == 1
        assert_same_state(target, s1, what="step 1, now the newest")
        again = _state(3)
        mgr.save(2, again).wait()  # step 2 is free again: the run saves there
        got = _state(9)
        assert mgr.restore(got) == 2
        assert_same_state(got, again, what="the new step 2")


def test_an_intact_step_is_refused_with_nothing_deleted(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError) as e:
        mgr.delete(2, damaged=True)
    msg = str(e.value)
    assert "step 2 under" in msg and "verifies intact" in msg and "nothing was deleted" in msg, msg
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]


def test_a_step_whose_manifest_does_not_validate_is_deleted(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    (tmp_path / step_dir(1) / "manifest.json").write_bytes(b'{"format_version": 5, "step": 1')
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.delete(1, damaged=True)
        assert mgr.steps() == [2] and not (tmp_path / step_dir(1)).exists()


def test_files_a_later_step_references_are_kept(tmp_path: Path) -> None:
    """Step 2 is incremental: its unchanged tensor ``b`` lives in step 1's file. Deleting a
    damaged step 1 (its ``a`` flipped) keeps that file, and step 2 still restores bit for bit."""
    s1 = _state(1)
    s2 = {"a": _state(2)["a"], "b": s1["b"].clone()}
    with CheckpointManager(tmp_path, async_save=False, incremental=True) as mgr:
        mgr.save(1, s1)
        mgr.save(2, s2)
        refs = [c["file"] for c in mgr.manifest(2).to_json()["leaves"]["b"]["chunks"]]
    assert refs and all(f.startswith(f"../{step_dir(1)}/") for f in refs), refs
    _flip(tmp_path, 1, "a")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.delete(1, damaged=True)
        assert mgr.steps() == [2] and not (tmp_path / manifest_path(1)).exists()
        assert all((tmp_path / step_dir(2) / f).resolve().is_file() for f in refs)
        got = _state(9)
        assert mgr.restore(got) == 2
    assert_same_state(got, s2, what="step 2, whose b lives in step 1's file")


class _FailingReads(LocalStorage):
    """Every ranged read fails: the storage cannot answer (no server fails on cue)."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        raise OSError("connection reset by peer")


class _FailingStats(LocalStorage):
    """Asking a data file's size fails (verify records that as a read problem, not damage)."""

    def size(self, path: str) -> int:
        if "/data/" in path:
            raise StorageError(f"HEAD {path}: 503 Slow Down")
        return super().size(path)


@pytest.mark.parametrize("storage_cls", [_FailingReads, _FailingStats], ids=["reads-fail", "stats-fail"])
def test_a_step_the_storage_cannot_be_asked_about_is_not_deleted(tmp_path: Path, storage_cls: type) -> None:
    """A storage error proves no damage: it propagates, or the step is refused as unchecked."""
    from shardkeeper.core.lifecycle.delete_damaged import delete_damaged

    _two_steps(tmp_path)
    with pytest.raises((OSError, ValueError)) as e:
        delete_damaged(storage_cls(tmp_path), 2)
    msg = str(e.value)
    if storage_cls is _FailingReads:
        assert "connection reset by peer" in msg, msg
    else:
        assert "could not be checked" in msg and "503 Slow Down" in msg and "nothing was deleted" in msg, msg
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]


def test_cli_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _two_steps(tmp_path)
    code, _, err = run_cli(capsys, "delete", tmp_path, 2)
    assert code == 2 and "newest committed step" in err and "--damaged" in err, err
    code, _, err = run_cli(capsys, "delete", tmp_path, 2, "--damaged")
    assert code == 2 and "verifies intact" in err, err
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]
    _flip(tmp_path, 2)
    code, out, err = run_cli(capsys, "delete", tmp_path, 2, "--damaged", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["deleted"] and doc["step"] == 2 and any("digest" in d for d in doc["damage"]), doc
    code, _, err = run_cli(capsys, "delete", tmp_path, 1)
    assert code == 2 and "newest committed step" in err, err  # step 1 is the newest now
    code, _, err = run_cli(capsys, "delete", tmp_path, 7)
    assert code == 2 and "no manifest" in err, err
    assert committed_steps(LocalStorage(tmp_path)) == [1]


def test_verify_says_a_file_it_could_not_stat_is_unchecked_not_missing(tmp_path: Path) -> None:
    """A failed stat (the storage did not answer) is a read problem; verify used to also call
    the file missing, which a deletion of damaged steps would have taken as damage."""
    from shardkeeper.core.verify.step import verify_step

    _two_steps(tmp_path)
    report = verify_step(_FailingStats(tmp_path), 2)
    kinds = {p.kind for p in report.problems}
    assert kinds == {"read"}, [p.message for p in report.problems]


def _break_entry(root: Path, step: int, how: str) -> None:
    """Make the entry on the way to ``step``'s data files something the format never puts
    there: a file where ``data/`` (or a prefix directory under it) is, a link loop, or a link
    that leaves the root."""
    steps_dir = root / step_dir(step)
    (first,) = sorted(p for p in (steps_dir / "data").rglob("*") if p.is_file())[:1]
    where = first.parent if how == "prefix-is-a-file" else steps_dir / "data"
    import shutil

    shutil.rmtree(where)
    if how in ("data-is-a-file", "prefix-is-a-file"):
        where.write_bytes(b"x")
    elif how == "link-loop":
        where.symlink_to(where.name)
    else:
        outside = root.parent / f"{root.name}-elsewhere"
        outside.mkdir()
        (outside / "theirs.txt").write_bytes(b"not the checkpoint's")
        where.symlink_to(outside)


@pytest.mark.parametrize("how", ["data-is-a-file", "prefix-is-a-file", "link-loop", "link-leaving-the-root"])
def test_a_step_whose_data_path_is_the_wrong_kind_of_entry_is_damaged_and_deleted(tmp_path: Path, how: str) -> None:
    """Restore treats a step whose data files sit behind a file, a link loop or a link out of
    the root as damaged (it falls back); verify called these unreadable, so ``damaged=True``
    refused to delete the step it could not restore from."""
    from shardkeeper.core.verify.step import verify_step

    root = tmp_path / "root"
    s1, _ = _two_steps(root, **({"data_prefixes": 16} if how == "prefix-is-a-file" else {}))
    _break_entry(root, 2, how)
    report = verify_step(LocalStorage(root), 2)
    assert not report.ok and "read" not in {p.kind for p in report.problems}, [str(p) for p in report.problems]
    with CheckpointManager(root) as mgr:
        target = _state(9)
        assert mgr.restore(target) == 1, "restore falls back past the damaged step"
        assert_same_state(target, s1, what="step 1")
        assert mgr.delete(2, damaged=True)
        assert mgr.steps() == [1]
    if how == "link-leaving-the-root":  # never deleted through the link
        assert (tmp_path / "root-elsewhere" / "theirs.txt").read_bytes() == b"not the checkpoint's"
    left = root / step_dir(2)
    assert not left.exists() and not left.is_symlink(), sorted(left.rglob("*"))


def _encrypted_two_steps(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cryptography")
    import base64

    monkeypatch.setenv("SK_DEL_KEY", base64.b64encode(bytes(range(32))).decode())
    monkeypatch.setenv("SK_DEL_OTHER", base64.b64encode(bytes(range(32, 64))).decode())
    _two_steps(root, encryption="env:SK_DEL_KEY")


def _flip_ciphertext(root: Path, step: int) -> None:
    (path,) = sorted((root / step_dir(step) / "data").glob("*"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_an_intact_encrypted_step_is_not_deleted_with_the_key_a_wrong_key_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step is verified through the view that authenticates: with the right key it is
    intact; a wrong key is no damage; without a key nothing can be checked."""
    from shardkeeper.core import EncryptionKeyError

    _encrypted_two_steps(tmp_path, monkeypatch)
    with CheckpointManager(tmp_path, encryption="env:SK_DEL_KEY") as mgr, pytest.raises(ValueError, match="intact"):
        mgr.delete(2, damaged=True)
    with CheckpointManager(tmp_path, encryption="env:SK_DEL_OTHER") as mgr, pytest.raises(EncryptionKeyError):
        mgr.delete(2, damaged=True)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError, match="no key was given"):
        mgr.delete(2, damaged=True)
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]


def test_an_intact_step_of_a_moved_root_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest that authenticates but names another root (the root was moved) proves no
    damage: ``--damaged`` deleted it, the newest step included, with every byte intact."""
    _encrypted_two_steps(tmp_path / "orig", monkeypatch)
    moved = tmp_path / "moved"
    (tmp_path / "orig").rename(moved)
    code, _, err = run_cli(capsys, "delete", moved, 2, "--damaged", "--key", "env:SK_DEL_KEY")
    assert code == 2 and "bound to another root" in err and "nothing was deleted" in err, err
    assert "--encryption-root" in err, err
    with CheckpointManager(moved, encryption="env:SK_DEL_KEY") as mgr, pytest.raises(ValueError, match="intact"):
        mgr.delete(2, damaged=True)
    assert committed_steps(LocalStorage(moved)) == [1, 2]
    code, _, err = run_cli(
        capsys, "delete", moved, 2, "--damaged", "--key", "env:SK_DEL_KEY", "--encryption-root", tmp_path / "orig"
    )
    assert code == 2 and "verifies intact" in err, err  # its own root named: intact, as it is


def test_a_plain_step_planted_in_an_encrypted_root_is_deleted_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone who can write to the root can put a valid unencrypted step above the newest:
    restore with the key passes over it, but saves below it are refused, so it must be
    deletable; and so is a manifest whose encryption member was damaged (not at its end)."""
    _encrypted_two_steps(tmp_path / "root", monkeypatch)
    _two_steps(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / step_dir(2)).rename(tmp_path / "root" / step_dir(1000))
    code, out, err = run_cli(capsys, "delete", tmp_path / "root", 1000, "--damaged", "--key", "env:SK_DEL_KEY")
    assert code == 0 and "not encrypted" in out, (out, err)
    with CheckpointManager(tmp_path / "root", encryption="env:SK_DEL_KEY", async_save=False) as mgr:
        assert mgr.steps() == [1, 2]
        mgr.save(3, _state(3))  # the run goes on where it was
        manifest = tmp_path / "root" / step_dir(3) / "manifest.json"
        manifest.write_bytes(manifest.read_bytes() + b"\n")  # the MAC member no longer at the end
        assert mgr.delete(3, damaged=True) and mgr.steps() == [1, 2]


def test_a_step_saved_before_encryption_is_not_deleted_with_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A root never encrypted (or its steps from before encryption was turned on): a key
    given by mistake proves no damage; ``--damaged --key`` deleted every step, exit 0."""
    _encrypted_two_steps(tmp_path / "unused", monkeypatch)  # (sets the keys)
    plain = tmp_path / "plain"
    _two_steps(plain)
    code, _, err = run_cli(capsys, "delete", plain, 2, "--damaged", "--key", "env:SK_DEL_KEY")
    assert code == 2 and "saved without encryption" in err and "nothing was deleted" in err, err
    with CheckpointManager(plain, encryption="env:SK_DEL_KEY") as mgr, pytest.raises(ValueError, match="without a key"):
        mgr.delete(1, damaged=True)
    assert committed_steps(LocalStorage(plain)) == [1, 2]
    with CheckpointManager(plain, encryption="env:SK_DEL_KEY", async_save=False) as mgr:
        mgr.save(3, _state(3))  # encryption turned on: the plain steps below stay refused
        with pytest.raises(ValueError, match="saved without encryption"):
            mgr.delete(2, damaged=True)
    assert committed_steps(LocalStorage(plain)) == [1, 2, 3]


def test_a_damaged_encrypted_step_is_deleted_by_the_cli_and_the_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ciphertext byte flipped: the block fails authentication, which is damage."""
    _encrypted_two_steps(tmp_path, monkeypatch)
    _flip_ciphertext(tmp_path, 2)
    code, out, err = run_cli(capsys, "delete", tmp_path, 2, "--damaged", "--key", "env:SK_DEL_KEY")
    assert code == 0 and "deleted damaged step 2" in out and "authentication" in out, (out, err)
    assert committed_steps(LocalStorage(tmp_path)) == [1]
    with CheckpointManager(tmp_path, encryption="env:SK_DEL_KEY", async_save=False) as mgr:
        mgr.save(2, _state(5))
        _flip_ciphertext(tmp_path, 2)
        assert mgr.delete(2, damaged=True) and mgr.steps() == [1]


def test_damaged_takes_a_bool(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(TypeError, match="True or False"):
        mgr.delete(2, damaged="no")  # type: ignore[arg-type]
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]


@pytest.mark.multiprocess
def test_every_rank_raises_the_coordinators_refusal_with_its_reason(tmp_path: Path) -> None:
    """``delete(step, damaged=True)`` is a collective: rank 0 verifies and deletes. A refusal
    (intact, no manifest) used to reach the other ranks as a bare ``CheckpointError`` that said
    only "see rank 0's error"; every rank now raises the same type with the same reason."""
    from .._launch import run_workers

    out = tmp_path / "out"
    out.mkdir()
    res = run_workers(3, "delete_worker.py", str(tmp_path / "root"), str(out), timeout_s=120)
    assert res.returncode == 0, res.stdout[-4000:]
    seen = [json.loads((out / f"r{r}.json").read_text()) for r in range(3)]
    for s in seen:
        kind, msg = s["intact"]
        assert kind == "ValueError" and "verifies intact" in msg and "nothing was deleted" in msg, s
        kind, msg = s["missing"]
        assert kind == "CheckpointNotFoundError" and "step 7" in msg and "no manifest" in msg, s
        assert s["damaged"] == ["returned", "True"] and s["steps"] == [1], s
        kind, msg = s["odd root"]
        assert kind == "ValueError" and "verifies intact" in msg and "odd-" in msg, s
    for s in seen[1:]:  # the others say whose refusal it is
        assert "rank 0" in s["intact"][1] and f"rank {s['rank']}" in s["intact"][1], s
