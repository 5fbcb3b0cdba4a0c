"""The plugin's writes outside a checkpoint root (pointer files such as ``last.ckpt``) and its
path index under the root never write through a link planted under a name they write."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from shardkeeper.core.storage import LocalStorage
from shardkeeper.lightning import paths
from shardkeeper.lightning.paths import INDEX_NAME, PathIndex, read_pointer, write_pointer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(b"keep")
    return d


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"keep"


def test_a_pointer_is_never_written_through_a_link_at_its_temporary_or_its_name(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its temporary's name guessed (the name is random: here the guess is made right), a
    dangling link planted there used to be followed (a file created outside) and then renamed
    into place: ``last.ckpt`` became a link to that outside file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    fixed = uuid.UUID(int=0xABCDEF)
    monkeypatch.setattr(paths.uuid, "uuid4", lambda: fixed)
    last = ck / "last.ckpt"
    Path(f"{last}.{fixed.hex[:8]}.tmp").symlink_to(outside / "new")
    write_pointer(str(last), str(tmp_path / "root"), 4)
    assert not last.is_symlink() and sorted(p.name for p in ck.iterdir()) == ["last.ckpt"]
    _untouched(outside)
    last.unlink()
    last.symlink_to(outside / "victim")  # a link at the pointer's own name is replaced
    write_pointer(str(last), str(tmp_path / "root"), 6)
    assert not last.is_symlink()
    target = read_pointer(str(last))
    assert target is not None and target.step == 6
    _untouched(outside)


def test_the_path_index_never_writes_into_a_hard_link_at_its_temporary(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    idx = PathIndex(LocalStorage(root, fsync=False))
    idx.set("/ck/last.ckpt", 2)
    idx.flush()
    os.link(outside / "victim", root / f".{INDEX_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
    idx.set("/ck/last.ckpt", 4)
    idx.flush()
    assert PathIndex(LocalStorage(root, fsync=False)).paths == {"/ck/last.ckpt": 4}
    assert [p.name for p in root.iterdir()] == [INDEX_NAME]
    _untouched(outside)
