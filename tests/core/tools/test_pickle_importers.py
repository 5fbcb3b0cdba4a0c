"""Importers of pickled checkpoints, and what the CLI prints from a manifest.

- The DCP importer (``import_dcp``, ``shardkeeper import``) unpickles nothing unless
  ``trust_pickle is True``: a real DCP directory whose ``.metadata`` and object entry each
  create a folder when unpickled is refused for every other value, with nothing created.
- Two DCP entries that map to one shardkeeper key (``model.module.x`` and ``model.x``; a tensor
  and an object) are refused, naming both, before anything is written.
- ``shardkeeper ls/inspect/verify`` print no control character from a manifest (keys,
  metadata, object values, errors quoting them); ``--json`` stays exact JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardkeeper.core
from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.state.unpickle import require_trust
from shardkeeper.core.tools.dcp_import import import_dcp, load_dcp, read_dcp_metadata
from tests.hostile_pickle import UNTRUSTED, Trace

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:unpickling .* \\(trust_pickle=True\\)"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed.checkpoint"),
]


# ---------------------------------------------------------------------------------------------
# trust_pickle: the one gate


def _traced_dcp(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A DCP directory whose object entry and whose ``.metadata`` each create a folder when
    unpickled: (directory, object trace, metadata trace)."""
    src, obj_trace, md_trace = tmp_path / "dcp", tmp_path / "trace-object", tmp_path / "trace-metadata"
    dcp.save(
        {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": {"note": Trace(obj_trace)}}, checkpoint_id=str(src)
    )
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)  # DCP's own metadata, written back with one more (traced) attribute
    md.__dict__["trace"] = Trace(md_trace)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert not obj_trace.exists() and not md_trace.exists()
    return src, obj_trace, md_trace


@pytest.mark.parametrize("trust", UNTRUSTED, ids=repr)
def test_dcp_import_unpickles_nothing_unless_trust_is_true(tmp_path: Path, trust: object) -> None:
    src, obj_trace, md_trace = _traced_dcp(tmp_path)
    root = tmp_path / "root"
    for call in (
        lambda: import_dcp(src, root, step=1, trust_pickle=trust, progress=False),  # type: ignore[arg-type]
        lambda: read_dcp_metadata(src, trust_pickle=trust),  # type: ignore[arg-type]
        lambda: load_dcp(src, trust_pickle=trust),
    ):  # type: ignore[arg-type]
        with pytest.raises(PermissionError) as refused:
            call()
        assert not obj_trace.exists() and not md_trace.exists(), f"unpickled before the refusal: {refused.value}"
        assert str(refused.value).startswith(f"{src}: ") and "trust_pickle=True (CLI: --trust-pickle)" in str(
            refused.value
        ), refused.value
    assert not root.exists()


def test_dcp_import_with_trust_reads_the_pickles_and_imports(tmp_path: Path) -> None:
    """The traces are live: with True both are unpickled, and the import works."""
    src, obj_trace, md_trace = _traced_dcp(tmp_path)
    m = import_dcp(src, tmp_path / "root", step=3, trust_pickle=True, progress=False)
    assert md_trace.is_dir() and obj_trace.is_dir()
    assert m.leaves["extra/note"].value is None  # what the traced object unpickles to
    with CheckpointManager(tmp_path / "root") as mgr:
        got = {"model": {"w": torch.zeros(2, 3)}}
        assert mgr.restore(got, only=["model/*"]) == 3
    assert torch.equal(got["model"]["w"], torch.arange(6.0).reshape(2, 3))


def test_cli_import_needs_trust_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, obj_trace, md_trace = _traced_dcp(tmp_path)
    assert main(["import", str(src), str(tmp_path / "root"), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{src}: " in err and "--trust-pickle" in err
    assert not obj_trace.exists() and not md_trace.exists()
    assert main(["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust-pickle", "--no-progress"]) == 0
    assert md_trace.is_dir()


def test_the_gate_names_a_truthy_value_it_refuses(tmp_path: Path) -> None:
    with pytest.raises(PermissionError, match=r"trust_pickle='false' is not True"):
        require_trust(tmp_path, trust_pickle="false")
    require_trust(tmp_path, trust_pickle=True)


def test_possible_pickles_lists_every_file_not_known_safe_at_any_depth(tmp_path: Path) -> None:
    from shardkeeper.core.state.unpickle import possible_pickles

    for rel in (
        "model.safetensors",
        "config.json",
        "notes.txt",
        "pytorch_model/latest",
        "a/b/.metadata",
        "a/b/__0_0.distcp",
        "x.pt",
        "opt.bin",
        "r.pkl",
        "w.pth",
        "sub/unknown",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    outside = tmp_path.parent / f"{tmp_path.name}-linked"
    outside.mkdir()
    (outside / "state.pt").write_bytes(b"")
    (tmp_path / "link").symlink_to(outside, target_is_directory=True)
    (outside / "loop").symlink_to(outside, target_is_directory=True)  # followed once only
    assert possible_pickles(tmp_path) == sorted(
        ["a/b/.metadata", "a/b/__0_0.distcp", "link/state.pt", "opt.bin", "r.pkl", "sub/unknown", "w.pth", "x.pt"]
    )


# ---------------------------------------------------------------------------------------------
# DCP keys that collide after normalization


@pytest.mark.parametrize(
    "sd, first, second",
    [
        ({"model": {"module.x": 1, "x": 2}}, "model.module.x", "model.x"),  # two objects
        ({"model": {"module.w": torch.ones(2), "w": 5}}, "model.module.w", "model.w"),  # a tensor and an object
        ({"model": {"module.w": torch.ones(2), "w": torch.zeros(2)}}, "model.module.w", "model.w"),  # two tensors
    ],
    ids=["object-object", "tensor-object", "tensor-tensor"],
)
def test_dcp_keys_that_collide_are_refused_naming_both(tmp_path: Path, sd: dict, first: str, second: str) -> None:
    src = tmp_path / "dcp"
    dcp.save(sd, checkpoint_id=str(src))
    root = tmp_path / "root"
    with pytest.raises(StateMismatchError) as e:
        import_dcp(src, root, step=1, trust_pickle=True, progress=False)
    msg = str(e.value)
    assert str(src) in msg and "'model/" in msg and "rename or drop one" in msg
    assert f"{first!r}" in msg and f"{second!r}" in msg, msg
    assert not root.exists() or not any(p.is_file() for p in root.rglob("*"))  # nothing written


# ---------------------------------------------------------------------------------------------
# The CLI prints no control character from a manifest

HOSTILE = "\x1b[2J\r\x07\u202e"  # clear screen, carriage return, bell, right-to-left override


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if not c.isprintable() and c != "\n"}


@pytest.fixture
def hostile_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    state = {"model": {f"w{HOSTILE}x": torch.arange(4.0)}, "extra": {"note": f"v{HOSTILE}y", f"k{HOSTILE}": 1}}
    with CheckpointManager(root) as mgr:
        mgr.save(1, state, async_save=False, metadata={f"owner{HOSTILE}": f"m{HOSTILE}z"})
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"model": {"w": torch.ones(2)}}, async_save=False)
    m = root / "step-000000000001" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["created_at"] = f"2026{HOSTILE}"  # as another writer could have put it
    m.write_text(json.dumps(doc))
    m = root / "step-000000000002" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["leaves"][f"model/w{HOSTILE}"] = doc["leaves"].pop("model/w")
    doc["leaves"][f"model/w{HOSTILE}"]["shape"] = [3]  # does not tile: an error quoting the key
    m.write_text(json.dumps(doc))
    data = next((root / "step-000000000001" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a digest mismatch in the tensor: verify names its key
    data.write_bytes(bytes(raw))
    return root


def test_cli_escapes_control_characters_from_the_manifest(
    hostile_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(hostile_root)
    runs = {
        "ls": (["ls", root], 0),
        "inspect": (["inspect", root, "1"], 0),
        "inspect-bad": (["inspect", root, "2"], 2),  # the error quotes the key
        "verify": (["verify", root, "1"], 1),
        "verify-all": (["verify", root, "-v"], 1),
    }
    seen = ""
    for name, (argv, rc) in runs.items():
        assert main(argv) == rc, name
        out = capsys.readouterr()
        assert not _raw_controls(out.out) and not _raw_controls(out.err), (name, out)
        seen += out.out + out.err
    for shown in (
        "w\\x1b[2J\\r\\x07\\u202ex",
        "owner\\x1b[2J",
        "m\\x1b[2J\\r\\x07\\u202ez",
        "2026\\x1b[2J",
        "k\\x1b[2J\\r\\x07\\u202e",
    ):
        assert shown in seen, shown  # escaped, still readable
    assert '"v\\u001b[2J\\r\\u0007\\u202ey"' in seen  # the object value, as inspect previews it


def test_cli_json_output_is_exact(hostile_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(hostile_root), "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert not _raw_controls(out)
    doc = json.loads(out)
    assert doc["metadata"][f"owner{HOSTILE}"] == f"m{HOSTILE}z"
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert leaves["extra/note"]["value"] == f"v{HOSTILE}y" and f"model/w{HOSTILE}x" in leaves
    assert main(["ls", str(hostile_root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["created_at"] == f"2026{HOSTILE}"


def test_cli_subprocess_prints_no_control_character(hostile_root: Path) -> None:
    src = Path(shardkeeper.core.__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    for argv in (["inspect", str(hostile_root), "1"], ["verify", str(hostile_root)]):
        res = subprocess.run(
            [sys.executable, "-m", "shardkeeper.core.cli", *argv], capture_output=True, text=True, env=env, timeout=60
        )
        assert res.returncode in (0, 1), res.stderr
        assert not _raw_controls(res.stdout) and not _raw_controls(res.stderr), (res.stdout, res.stderr)
        assert "w\\x1b[2J\\r\\x07\\u202ex" in res.stdout + res.stderr
