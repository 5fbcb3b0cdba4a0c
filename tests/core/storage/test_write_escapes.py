"""No write escapes the folder it is meant for: ``export`` (with and without --overwrite),
``import`` and every local root's ``put`` never write through a link (symbolic or hard)
planted under a name they write, and never leave a link under a final name."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("numpy")

from shardkeeper.core.storage import LocalStorage  # noqa: E402
from shardkeeper.core.storage.safe_files import atomic_file, write_file  # noqa: E402
from shardkeeper.core.storage.wrapper import StorageWrapper  # noqa: E402
from shardkeeper.core.tools.export import export_safetensors  # noqa: E402

try:
    from .._builders import run_cli as run
    from .._builders import tensor, write_step
except ImportError:
    from _builders import run_cli as run
    from _builders import tensor, write_step

pytestmark = pytest.mark.timeout(60)
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    storage = LocalStorage(root, fsync=False)
    write_step(storage, 1, {f"model/l{i}": tensor("float32", (32, 32), i) for i in range(2)})
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder the export must never write in; ``victim`` holds bytes that must stay."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(b"keep")
    return d


def _no_link_and_untouched(folder: Path, outside: Path) -> None:
    links = [p.name for p in folder.iterdir() if p.is_symlink()]
    assert links == [], f"links left in {folder}: {links}"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"keep"


def test_export_overwrite_removes_a_dangling_partial_link_instead_of_writing_through_it(
    root: Path, tmp_path: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / f"{SHARD}.partial").symlink_to(outside / "new")  # dangling: isfile() says no
    (out / "model.safetensors.index.json.partial").symlink_to(outside / "victim")
    (out / "old.safetensors").symlink_to(outside / "victim")  # an earlier export's name, as a link
    code, res, err = run(capsys, "export", root, "1", "--to", out, "--overwrite", "--json")
    assert code == 0, err
    _no_link_and_untouched(out, outside)
    assert sorted(json.loads(res)["removed"]) == [
        f"{SHARD}.partial",
        "model.safetensors.index.json.partial",
        "old.safetensors",
    ]
    assert sorted(p.name for p in out.iterdir()) == [SHARD, "model.safetensors.index.json"]


class _Planting(StorageWrapper):
    """Plants links in the export folder at the first read of a chunk: after the folder was
    found empty, while the export runs (another process writing there, in time)."""

    def __init__(self, inner: Any, plant: dict[Path, Path]) -> None:
        super().__init__(inner)
        self.plant = plant

    def _now(self) -> None:
        for link, target in self.plant.items():
            link.symlink_to(target)
        self.plant = {}

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self._now()
        return bytes(self.inner.read_range(path, offset, length))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self._now()
        self.inner.read_into(path, offset, buffer)


def test_export_never_follows_links_planted_after_the_emptiness_check(
    root: Path, tmp_path: Path, outside: Path
) -> None:
    out = tmp_path / "hf"
    second = "model-00002-of-00002.safetensors"
    plant = {
        out / f"{second}.partial": outside / "new",  # the next shard's temporary, dangling
        out / "model-00001-of-00002.safetensors": outside / "victim",  # a final name
        out / "model.safetensors.index.json.partial": outside / "victim",  # the index's temporary
        out / "model.safetensors.index.json": outside / "victim",
    }
    storage = _Planting(LocalStorage(root, fsync=False), plant)
    res = export_safetensors(storage, 1, to=out, max_shard_size=4096, progress=False)
    assert res.files == ["model-00001-of-00002.safetensors", second]
    _no_link_and_untouched(out, outside)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_failed_export_removes_its_files_and_no_file_outside(root: Path, tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors.index.json").mkdir()  # the index cannot be put in place
    with pytest.raises(IsADirectoryError):
        export_safetensors(root, 1, to=out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors.index.json"]


def test_atomic_file_unlinks_a_hard_link_at_its_temporary_and_never_leaves_a_link(
    tmp_path: Path, outside: Path
) -> None:
    final = tmp_path / "pointer.json"
    final.symlink_to(outside / "victim")
    os.link(outside / "victim", tmp_path / "pointer.json.tmp")  # the same inode as the victim
    with atomic_file(str(final), str(tmp_path / "pointer.json.tmp")) as f:
        f.write(b"new")
    assert not final.is_symlink() and final.read_bytes() == b"new"
    assert not (tmp_path / "pointer.json.tmp").exists()
    assert (outside / "victim").read_bytes() == b"keep"
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_file(str(tmp_path / "dir"), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "outside", "pointer.json"]


def _predicted_tmp(root: Path, name: str) -> Path:
    """The temporary a local root's ``put`` of ``name`` uses in this thread."""
    return root / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"


def test_a_local_roots_put_never_writes_into_a_hard_link_at_its_temporary(tmp_path: Path, outside: Path) -> None:
    """``put`` (the LATEST hint, Lightning's path index, tier markers) writes a temporary
    file of a predictable name: one planted as a hard link to a file elsewhere used to be
    truncated and written, i.e. the bytes landed in the outside file."""
    root = tmp_path / "root"
    storage = LocalStorage(root, fsync=False)
    storage.put("LATEST", b"1")
    os.link(outside / "victim", _predicted_tmp(root, "LATEST"))
    storage.put("LATEST", b"2")
    assert (root / "LATEST").read_bytes() == b"2" and (outside / "victim").read_bytes() == b"keep"
    (root / "LATEST").unlink()
    _predicted_tmp(root, "LATEST").symlink_to(outside / "victim")
    storage.put("LATEST", b"3")  # a symbolic link there is replaced too, not refused
    assert (root / "LATEST").read_bytes() == b"3" and not (root / "LATEST").is_symlink()
    _no_link_and_untouched(root, outside)


def test_import_never_writes_through_links_planted_in_the_root(
    tmp_path: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(16.0)}}, checkpoint_id=str(src))
    root = tmp_path / "root"
    step_dir = root / "step-000000000005"
    step_dir.mkdir(parents=True)
    os.link(outside / "victim", _predicted_tmp(root, "LATEST"))  # the hint, written by this thread
    os.link(outside / "victim", _predicted_tmp(step_dir, "manifest.json"))  # the commit's temporary
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = run(capsys, "import", src, root, "--step", "5", "--trust-pickle", "--no-progress")
    assert code == 0, err
    assert (outside / "victim").read_bytes() == b"keep"
    assert (root / "LATEST").read_text().strip() == "5"
    assert os.stat(step_dir / "manifest.json").st_nlink == 1
    assert run(capsys, "verify", root)[0] == 0
