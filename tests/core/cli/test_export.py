"""``shardkeeper export``: --json, and a folder that is not empty (stale shards that loaders
reading every *.safetensors file would pick up) refused unless --overwrite, which removes only
an earlier export's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("numpy")
from safetensors import safe_open  # noqa: E402

from shardkeeper.core.storage import LocalStorage  # noqa: E402
from shardkeeper.core.tools.export import INDEX_NAME  # noqa: E402

try:
    from .._builders import run_cli as run
    from .._builders import tensor, write_step
except ImportError:
    from _builders import run_cli as run
    from _builders import tensor, write_step


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    storage = LocalStorage(root, fsync=False)
    write_step(storage, 1, {f"model/l{i}": tensor("float32", (32, 32), i) for i in range(4)})
    write_step(storage, 2, {"model/only": tensor("float32", (8, 8), 9)})
    return root


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_export_json(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "hf"
    code, out, err = run(capsys, "export", root, "1", "--to", out_dir, "--max-shard-size", "5KB", "--json")
    assert code == 0 and err == ""
    res = json.loads(out)
    assert res["step"] == 1 and res["directory"] == str(out_dir)
    assert res["index"] == str(out_dir / INDEX_NAME)
    assert res["tensors"] == 4 and res["total_size"] == 4 * 32 * 32 * 4
    assert res["files"] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert res["removed"] == []
    assert _names(out_dir) == sorted([*res["files"], INDEX_NAME])


def test_export_into_a_folder_that_is_not_empty(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "hf"
    code, _, _ = run(capsys, "export", root, "1", "--to", out_dir, "--max-shard-size", "5KB")
    assert code == 0 and len(list(out_dir.glob("*.safetensors"))) == 4
    (out_dir / "config.json").write_text("{}")
    (out_dir / "notes").mkdir()
    (out_dir / "notes" / "x.safetensors").write_bytes(b"not ours")  # below: never touched

    # Step 2 has one tensor: written over the four old shards, a glob would load five files.
    code, out, err = run(capsys, "export", root, "2", "--to", out_dir)
    assert code == 2 and out == ""
    assert f"export to {out_dir}: the folder is not empty" in err and "--overwrite" in err
    assert len(list(out_dir.glob("*.safetensors"))) == 4  # nothing written, nothing removed

    code, out, err = run(capsys, "export", root, "2", "--to", out_dir, "--overwrite", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert sorted(res["removed"]) == sorted([f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + [INDEX_NAME])
    assert _names(out_dir) == sorted(["config.json", "notes", "model-00001-of-00001.safetensors", INDEX_NAME])
    assert (out_dir / "notes" / "x.safetensors").read_bytes() == b"not ours"
    assert (out_dir / "config.json").read_text() == "{}"
    shards = list(out_dir.glob("*.safetensors"))
    assert len(shards) == 1
    with safe_open(str(shards[0]), "np") as f:
        assert list(f.keys()) == ["only"]
    index = json.loads((out_dir / INDEX_NAME).read_text())
    assert index["weight_map"] == {"only": "model-00001-of-00001.safetensors"}


def test_export_into_a_file(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    code, _, err = run(capsys, "export", root, "--to", f)
    assert code == 2 and "it is a file, not a folder" in err and f.read_bytes() == b"x"


def test_export_human_output_names_the_index(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "export", root, "--to", tmp_path / "hf")
    assert code == 0 and f"index: {tmp_path / 'hf' / INDEX_NAME}" in out and "exported step 2" in out
