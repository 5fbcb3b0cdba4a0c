"""Codecs across encryption states: an incremental save never references a file of another
encryption state, and on an encrypted root one file that does not authenticate is damage that
"restore the newest" falls back from, while a wrong key is still an error.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, EncryptionKeyError, LocalKeyProvider
from shardkeeper.core.format.layout import step_dir
from tests.checks import assert_same_state

K1 = LocalKeyProvider(b"\x11" * 32, "key one")
K2 = LocalKeyProvider(b"\x22" * 32, "key two")


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v))
    return {"w": torch.randn(256, 64, generator=g), "b": torch.full((64,), float(v))}


def _target() -> dict:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(64)}


def _referenced_dirs(root: Path, step: int) -> set[str]:
    m = json.loads((root / step_dir(step) / "manifest.json").read_bytes())
    files = {c["file"] for leaf in m["leaves"].values() for c in leaf.get("chunks", [])}
    return {f.split("/")[1] if f.startswith("../") else step_dir(step) for f in files}


@pytest.mark.parametrize(
    ("first", "second"),
    [(K1, None), (None, K1), (K1, K2)],
    ids=["encrypted-then-plain", "plain-then-encrypted", "other-key"],
)
def test_incremental_never_references_another_encryption_state(tmp_path: Path, first, second) -> None:
    state = _state(1)
    with CheckpointManager(tmp_path, encryption=first, async_save=False) as mgr:
        mgr.save(1, state)
    # the same content, so every chunk would be reused if the base were usable
    with CheckpointManager(tmp_path, encryption=second, incremental=True, keep_last=1, async_save=False) as mgr:
        mgr.save(2, state)
        assert mgr.steps() == [2], "retention should have removed step 1"
        assert _referenced_dirs(tmp_path, 2) == {step_dir(2)}, "step 2 references step 1's files"
        target = _target()
        assert mgr.restore(target) == 2
    assert_same_state(target, state)
    assert not (tmp_path / step_dir(1)).exists()


def test_incremental_within_one_encryption_state_still_reuses(tmp_path: Path) -> None:
    state = _state(3)
    with CheckpointManager(tmp_path, encryption=K1, incremental=True, async_save=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        assert _referenced_dirs(tmp_path, 2) == {step_dir(1)}
        target = _target()
        assert mgr.restore(target) == 2
    assert_same_state(target, state)


def _two_steps(root: Path) -> None:
    with CheckpointManager(root, encryption=K1, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))


def _replace_step_2(root: Path, other: Path) -> None:
    shutil.rmtree(root / step_dir(2))
    shutil.copytree(other / step_dir(2), root / step_dir(2))


def _unsealed(root: Path, tmp: Path) -> None:
    with CheckpointManager(tmp / "plain", async_save=False) as mgr:
        mgr.save(2, _state(9))
    _replace_step_2(root, tmp / "plain")


def _data_under_another_key(root: Path, tmp: Path) -> None:
    with CheckpointManager(tmp / "k2", encryption=K2, async_save=False) as mgr:
        mgr.save(2, _state(2))
    ours = sorted((root / step_dir(2) / "data").iterdir())[0]
    shutil.copyfile(sorted((tmp / "k2" / step_dir(2) / "data").iterdir())[0], ours)


def _plaintext_data(root: Path, tmp: Path) -> None:
    f = sorted((root / step_dir(2) / "data").iterdir())[0]
    f.write_bytes(b"\0" * f.stat().st_size)


@pytest.mark.parametrize(
    "damage",
    [_unsealed, _data_under_another_key, _plaintext_data],
    ids=["unsealed-manifest", "data-under-another-key", "plaintext-data"],
)
def test_one_unauthenticated_file_falls_back(tmp_path: Path, damage) -> None:
    root = tmp_path / "root"
    _two_steps(root)
    damage(root, tmp_path)
    target = _target()
    with warnings.catch_warnings(record=True) as caught, CheckpointManager(root, encryption=K1) as mgr:
        warnings.simplefilter("always")
        assert mgr.restore(target) == 1
    assert_same_state(target, _state(1))
    assert any("step 2" in str(w.message) and "damaged" in str(w.message) for w in caught)


def test_a_wrong_key_is_an_error_not_damage(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _two_steps(root)
    with CheckpointManager(root, encryption=K2) as mgr, pytest.raises(EncryptionKeyError, match="wrong key"):
        mgr.restore(_target())


def _copy_step(src: Path, dst: Path, step: int) -> None:
    shutil.rmtree(dst / step_dir(step), ignore_errors=True)
    shutil.copytree(src / step_dir(step), dst / step_dir(step))


def test_a_step_of_another_root_under_the_same_key_is_refused(tmp_path: Path) -> None:
    """Encrypted files and manifests are bound to their root: a whole step of another run
    sealed with the same key does not restore in its place (it falls back, as damage)."""
    root, other = tmp_path / "root", tmp_path / "other"
    _two_steps(root)
    with CheckpointManager(other, encryption=K1, async_save=False) as mgr:
        mgr.save(2, _state(9))
    _copy_step(other, root, 2)
    target = _target()
    with warnings.catch_warnings(record=True) as caught, CheckpointManager(root, encryption=K1) as mgr:
        warnings.simplefilter("always")
        assert mgr.restore(target) == 1
        with pytest.raises(Exception, match="written under the root") as e:
            mgr.restore(_target(), step=2)
    assert str(other.resolve()) in str(e.value) and "encryption_root=" in str(e.value)
    assert_same_state(target, _state(1))
    assert any("step 2" in str(w.message) for w in caught)


def test_a_data_file_of_another_root_is_refused(tmp_path: Path) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    _two_steps(root)
    _two_steps(other)
    ours = sorted((root / step_dir(2) / "data").iterdir())[0]
    theirs = sorted((other / step_dir(2) / "data").iterdir())[0]
    shutil.copyfile(theirs, ours)  # the same name, bytes of the other root
    with CheckpointManager(root, encryption=K1) as mgr:
        with pytest.raises(Exception, match="another root"):
            mgr.restore(_target(), step=2)
        target = _target()
        assert mgr.restore(target) == 1
    assert_same_state(target, _state(1))


def test_a_moved_root_reads_with_the_root_it_was_written_under(tmp_path: Path) -> None:
    root, moved = tmp_path / "root", tmp_path / "moved"
    _two_steps(root)
    shutil.copytree(root, moved)
    with CheckpointManager(moved, encryption=K1) as mgr:
        with pytest.raises(Exception, match=r"encryption_root="):
            mgr.restore(_target())
    target = _target()
    with CheckpointManager(moved, encryption=K1, encryption_root=str(root.resolve())) as mgr:
        assert mgr.restore(target) == 2
    assert_same_state(target, _state(2))
    # through a symlink to the same directory, nothing needs to be passed
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    with CheckpointManager(link, encryption=K1) as mgr:
        assert mgr.restore(_target()) == 2


def test_a_root_name_that_is_not_unicode_is_refused_when_encryption_binds_to_it(tmp_path: Path) -> None:
    root = str(tmp_path) + "/r\udcff"  # os.fsdecode of a non-UTF-8 directory name
    with pytest.raises(ValueError, match="not valid Unicode.*encryption_root="):
        CheckpointManager(root, encryption=K1)
    with CheckpointManager(root, encryption=K1, encryption_root="run-7", async_save=False) as mgr:
        mgr.save(1, _state(1))
        target = _target()
        assert mgr.restore(target) == 1
    assert_same_state(target, _state(1))
