"""``shardkeeper verify`` on a node's directory of a local tier: it holds its own ranks' files
and the copies or parity other nodes sent it, not every file of a step, so a file that is not
there is listed as held elsewhere, not reported as damage; the files that are there are
checked in full (a flipped byte is damage). The persistent root still reports a missing file
as damage. One process: a step of two files, one of them removed from the node's directory
as if another node held it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main

STEP_DIR = "step-000000000001"


def _saved(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """A step of two data files, in a persistent root and a node's directory."""
    root, node = tmp_path / "root", tmp_path / "node0"
    state = {f"t{i}": torch.arange(4096, dtype=torch.float32) + i for i in range(4)}
    with CheckpointManager(root, local=node, persist_every=1, max_files_per_rank=2, min_file_bytes=1) as mgr:
        mgr.save(1, state, async_save=False)
        mgr.wait_persisted()
    files = sorted((node / STEP_DIR / "data").iterdir())
    assert len(files) == 2, files
    return root, node, files


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", *argv])
    got = capsys.readouterr()
    return code, got.out + got.err


def test_files_other_nodes_hold_are_listed_not_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, node, files = _saved(tmp_path)
    files[1].unlink()  # (held by another node)
    code, out = _verify(capsys, str(node), "1")
    assert code == 0, out
    assert "is a node's directory of a local tier" in out and "step 1: OK (1 files" in out, out
    assert "1 file(s) not on this node" in out, out
    code, out = _verify(capsys, str(node), "1", "--json")
    report = json.loads(out[: out.rindex("}") + 1])
    assert report["ok"] and report["steps"][0]["elsewhere"] == [f"{STEP_DIR}/data/{files[1].name}"], report
    code, out = _verify(capsys, str(node), "1", "--logical")  # whole tensors: not here
    assert code == 0 and "logical digests not checked: 1 of its files are not in this node's directory" in out, out

    (root / STEP_DIR / "data" / files[1].name).unlink()  # the persistent root must hold every file
    code, out = _verify(capsys, str(root), "1")
    assert code == 1 and f"{files[1].name} is missing" in out, out


def test_a_damaged_file_in_a_node_directory_is_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, node, files = _saved(tmp_path)
    files[1].unlink()
    data = bytearray(files[0].read_bytes())
    data[len(data) - 100] ^= 1  # (in the tensor bytes)
    files[0].write_bytes(bytes(data))
    code, out = _verify(capsys, str(node))
    assert code == 1 and "step 1: DAMAGED (1 problem(s); 1 file(s) not on this node)" in out, out
    assert f"file {files[0]}: digest mismatch" in out or "digest mismatch" in out, out
