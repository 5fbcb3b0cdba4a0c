"""verify, the CLI, and the builder's shard layout, on checkpoints built without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from shardkeeper.core.cli import main
from shardkeeper.core.cli.display import format_table, human_size
from shardkeeper.core.commit.committed import committed_steps
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.root import verify_root
from shardkeeper.core.verify.step import verify_step

try:
    from .._builders import age_everything, tensor, write_step
    from .._builders import run_cli as run
except ImportError:
    from _builders import age_everything, tensor, write_step
    from _builders import run_cli as run

TORCH_FREE = [
    "shardkeeper.core.lifecycle.retention",
    "shardkeeper.core.lifecycle.delete_damaged",
    "shardkeeper.core.verify.step",
    "shardkeeper.core.codec.read",
    "shardkeeper.core.tools.export",
    "shardkeeper.core.cli",
    "shardkeeper.core.commit.committed",
    "shardkeeper.core.format.manifest",
    "shardkeeper.core.format.safetensors",
    "shardkeeper.core.format.digest",
    "shardkeeper.core.format.layout",
    "shardkeeper.core.storage",
]


@pytest.fixture
def root(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def storage(root):
    return LocalStorage(root, fsync=False)


def _w(seed=0):
    return tensor("float32", (6, 5), seed)


def _checkpoint(storage, step=100, **kw):
    return write_step(
        storage,
        step,
        {
            "model/w": _w(step),
            "model/b": tensor("bfloat16", (5,), step + 1),
            "optim/state/w/exp_avg": tensor("float32", (6, 5), step + 2),
        },
        objects={"progress/global_step": step, "optim/param_groups": [{"lr": 0.1}]},
        blobs={"extra/blob": b"\x00\x01binary\xff"},
        **kw,
    )


def _chunk(m, key, i=0):
    c = m.leaves[key].chunks[i]
    return c, f"{step_dir(m.step)}/{c.file}"


# ---------------------------------------------------------------------------- no torch


def test_modules_do_not_import_torch():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in TORCH_FREE)
        + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        + "assert not bad, bad\n"
        + "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# ---------------------------------------------------------------------------- the builder


def test_builder_shards_are_valid_safetensors(storage):
    w = np.arange(30, dtype=np.float32).reshape(6, 5)
    i = np.array([[1, -2], [3, 4]], dtype=np.int64)
    m = write_step(
        storage,
        7,
        {"model/w": ("float32", (6, 5), w.tobytes()), "model/i": ("int64", (2, 2), i.tobytes())},
        world_size=2,
    )
    assert committed_steps(storage) == [7]
    got: dict[str, np.ndarray] = {}
    for rel in m.files:
        with safe_open(str(storage.root / step_dir(7) / rel), framework="numpy") as f:
            assert f.metadata()["format"] == "pt"
            for name in f.keys():
                got[name] = f.get_tensor(name)
    # model/w split over two ranks along dim 0; model/i (2 rows) too.
    assert set(got) == {"model/w[0:3,0:5]", "model/w[3:6,0:5]", "model/i[0:1,0:2]", "model/i[1:2,0:2]"}
    np.testing.assert_array_equal(np.concatenate([got["model/w[0:3,0:5]"], got["model/w[3:6,0:5]"]]), w)
    np.testing.assert_array_equal(np.concatenate([got["model/i[0:1,0:2]"], got["model/i[1:2,0:2]"]]), i)
    # A whole tensor keeps its plain key.
    m2 = write_step(storage, 8, {"model/w": ("float32", (6, 5), w.tobytes())})
    (rel,) = m2.files
    with safe_open(str(storage.root / step_dir(8) / rel), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("model/w"), w)
    # Header padded so data starts 8-byte aligned.
    c = m2.leaves["model/w"].chunks[0]
    assert c.offset % 8 == 0


# ---------------------------------------------------------------------------- verify


def test_verify_clean(storage):
    m = _checkpoint(storage, world_size=3)
    r = verify_step(storage, 100)
    assert r.ok, r.problems
    assert r.files_checked == len(m.files) == 3
    assert r.chunks_checked == sum(len(leaf.chunks) for leaf in m.leaves.values())
    assert r.bytes_checked == sum(c.length for _, c in m.chunks())
    # Many reads per chunk (read size rounded to whole 64-byte blocks) still verify.
    assert verify_step(storage, 100, read_bytes=1).ok
    assert verify_step(storage, 100, read_bytes=130).ok


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_verify_flipped_byte(storage, capsys, algorithm):
    m = write_step(
        storage,
        100,
        {"model/w": tensor("float32", (40, 10), 1), "model/b": tensor("float32", (10,), 2)},
        algorithm=algorithm,
        block_bytes=256,
    )
    c, path = _chunk(m, "model/w")
    flip_at = c.offset + 700  # block 2 of the chunk: bytes [512, 768)
    p = storage.root / path
    data = bytearray(p.read_bytes())
    data[flip_at] ^= 0x01
    p.write_bytes(bytes(data))

    r = verify_step(storage, 100, read_bytes=512)
    assert [p.kind for p in r.problems] == ["digest"]
    prob = r.problems[0]
    assert prob.key == "model/w" and prob.file == path
    assert (prob.start, prob.end) == (c.offset + 512, c.offset + 768)
    assert prob.expected == c.digests[2] and prob.found != prob.expected

    code, out, err = run(capsys, "verify", storage.root)
    assert code == 1
    assert "model/w" in out and c.file.split("/")[-1] in out and "digest mismatch" in out
    assert "DAMAGED" in out
    code, out, _ = run(capsys, "verify", storage.root, "100", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    (p0,) = doc["steps"][0]["problems"]
    assert p0["key"] == "model/w" and p0["kind"] == "digest" and p0["start"] == c.offset + 512


def test_verify_limited_to_files_checks_those_alone(storage):
    """``files=``: a repair's check of one node's copies of the files a restore named."""
    m = _checkpoint(storage, world_size=3)
    c, damaged = _chunk(m, "model/w")
    p = storage.root / damaged
    data = bytearray(p.read_bytes())
    data[c.offset + 3] ^= 0x01
    p.write_bytes(bytes(data))
    others = sorted(f"{step_dir(100)}/{rel}" for rel in m.files if f"{step_dir(100)}/{rel}" != damaged)
    assert others
    clean = verify_step(storage, 100, files=others)
    assert clean.ok and clean.files_checked == len(others), clean.problems
    assert clean.chunks_checked == sum(1 for _, ch in m.chunks() if f"{step_dir(100)}/{ch.file}" in others)
    hit = verify_step(storage, 100, files=[damaged])
    assert [(q.kind, q.file) for q in hit.problems] == [("digest", damaged)] and hit.files_checked == 1
    assert not verify_step(storage, 100).ok


def test_verify_truncated_file(storage, capsys):
    m = _checkpoint(storage)
    c, path = _chunk(m, "optim/state/w/exp_avg")
    p = storage.root / path
    size = p.stat().st_size
    os.truncate(p, size - 10)
    r = verify_step(storage, 100)
    kinds = {p.kind for p in r.problems}
    assert "size" in kinds and "range" in kinds
    size_problem = next(p for p in r.problems if p.kind == "size")
    assert "truncated" in size_problem.message and str(size) in size_problem.message
    code, out, _ = run(capsys, "verify", storage.root)
    assert code == 1 and "truncated" in out


def test_verify_missing_file(storage, capsys):
    m = _checkpoint(storage, world_size=2)
    c, path = _chunk(m, "model/w", 1)
    (storage.root / path).unlink()
    r = verify_step(storage, 100)
    assert {p.kind for p in r.problems} == {"missing-file"}
    assert any("model/w" in p.message for p in r.problems)
    code, out, _ = run(capsys, "verify", storage.root, "100")
    assert code == 1 and "is missing" in out and "model/w" in out


def test_verify_header_disagrees(storage):
    m = write_step(storage, 100, {"model/w": tensor("float32", (4, 4), 1)})
    c, path = _chunk(m, "model/w")
    p = storage.root / path
    data = p.read_bytes()
    # Same length, different tensor name: the bytes still match their digests.
    p.write_bytes(data.replace(b'"model/w"', b'"model/v"', 1))
    r = verify_step(storage, 100)
    assert [x.kind for x in r.problems] == ["header"]
    assert "model/w" in r.problems[0].message


def test_verify_incremental_reference(storage):
    write_step(storage, 100, {"a": tensor("float32", (4, 4), 1)})
    m = write_step(storage, 200, {"b": tensor("float32", (2,), 2)}, reuse={"a": 100})
    assert m.leaves["a"].chunks[0].file.startswith(f"../{step_dir(100)}/data/")
    assert verify_step(storage, 200).ok
    (rel,) = [f for f in os.listdir(storage.root / step_dir(100) / "data")]
    (storage.root / step_dir(100) / "data" / rel).unlink()
    r = verify_step(storage, 200)
    assert [p.kind for p in r.problems] == ["missing-file"] and r.problems[0].key == "a"


def test_verify_root_reports_invalid_manifest(storage, capsys):
    _checkpoint(storage, 100)
    bad = storage.root / step_dir(200)
    bad.mkdir()
    (bad / "manifest.json").write_bytes(b"{not json")
    (storage.root / step_dir(300) / "data").mkdir(parents=True)  # uncommitted: not a problem
    r = verify_root(storage)
    assert [s.step for s in r.steps] == [100] and r.steps[0].ok
    assert [(p.step, p.kind) for p in r.problems] == [(200, "manifest")]
    code, out, _ = run(capsys, "verify", storage.root)
    assert code == 1 and "step 200" in out and "does not validate" in out
    code, out, _ = run(capsys, "verify", storage.root, "200")
    assert code == 1 and "step 200" in out


def test_verify_missing_step_exits_2(storage, capsys):
    _checkpoint(storage, 100)
    with pytest.raises(CheckpointNotFoundError):
        verify_step(storage, 999)
    code, out, err = run(capsys, "verify", storage.root, "999")
    assert code == 2 and out == ""
    assert "step 999 is not committed" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_verify_empty_root_exits_2(root, capsys):
    root.mkdir()
    code, _, err = run(capsys, "verify", root)
    assert code == 2 and "no committed checkpoint" in err
    code, _, err = run(capsys, "verify", root / "missing")
    assert code == 2 and "no such root" in err


def test_verify_clean_cli(storage, capsys):
    _checkpoint(storage, 100)
    _checkpoint(storage, 200)
    code, out, err = run(capsys, "verify", storage.root)
    assert code == 0, out + err
    assert "step 100: OK" in out and "step 200: OK" in out
    code, out, _ = run(capsys, "verify", storage.root, "--json")
    assert code == 0 and json.loads(out)["ok"] is True


# ---------------------------------------------------------------------------- ls / inspect / gc


def test_ls_empty_root(root, capsys):
    root.mkdir()
    code, out, err = run(capsys, "ls", root)
    assert code == 0 and "no checkpoints" in out and err == ""
    code, out, _ = run(capsys, "ls", root, "--json")
    assert code == 0 and json.loads(out)["steps"] == []
    # A root that is not there is a mistake, not an empty root (tests/core/cli/test_roots.py).
    code, out, err = run(capsys, "ls", root / "does-not-exist")
    assert code == 2 and out == "" and "no such root" in err


def test_ls(storage, capsys):
    _checkpoint(storage, 100, world_size=2)
    _checkpoint(storage, 1200, world_size=4)
    write_step(storage, 1300, {"w": _w()}, commit=False)
    code, out, err = run(capsys, "ls", storage.root)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "STATUS", "SIZE"]
    row = {int(line.split()[0]): line for line in lines[1:]}
    assert "committed" in row[100] and "uncommitted" in row[1300]
    assert row[1200].rstrip().endswith("LATEST")
    assert "KiB" in row[100] or " B " in row[100]
    # Columns align: every row is as wide as the STATUS column start.
    assert len({line.index(line.split()[1]) for line in lines[1:]}) == 1

    code, out, _ = run(capsys, "ls", storage.root, "--json")
    doc = json.loads(out)
    assert doc["latest_hint"] == 1200
    by = {s["step"]: s for s in doc["steps"]}
    assert by[100]["status"] == "committed" and by[100]["world_size"] == 2
    assert by[100]["leaves"] == 6 and by[100]["size_bytes"] > 0
    assert by[1300]["status"] == "uncommitted" and by[1300]["size_bytes"] is None
    assert by[1200]["latest_hint"] is True and by[100]["latest_hint"] is False


def test_inspect(storage, capsys):
    _checkpoint(storage, 100, world_size=2)
    _checkpoint(storage, 200, world_size=2)
    code, out, err = run(capsys, "inspect", storage.root)
    assert code == 0, err
    assert "step" in out and "200" in out and "model/w" in out and "[6, 5]" in out
    assert "progress/global_step" in out and "bfloat16" in out

    code, out, _ = run(capsys, "inspect", storage.root, "100", "--json", "--keys", "model/*")
    assert code == 0
    doc = json.loads(out)
    assert doc["step"] == 100 and doc["world_size"] == 2
    assert {leaf["key"] for leaf in doc["leaves"]} == {"model/w", "model/b"}
    w = next(leaf for leaf in doc["leaves"] if leaf["key"] == "model/w")
    assert w == {
        "key": "model/w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [6, 5],
        "chunks": 2,
        "size_bytes": 120,
        "stored_bytes": 120,
        "logical_digest": None,  # (the test builder records none: docs/format.md 6.1)
    }

    code, out, _ = run(capsys, "inspect", storage.root, "--json", "--keys", "progress/*")
    assert json.loads(out)["leaves"] == [{"key": "progress/global_step", "kind": "object", "value": 200}]

    code, _, err = run(capsys, "inspect", storage.root, "--keys", "nope/*")
    assert code == 2 and "nope/*" in err
    code, _, err = run(capsys, "inspect", storage.root, "555")
    assert code == 2 and "step 555 is not committed" in err


def test_gc_cli(storage, capsys):
    _checkpoint(storage, 100)
    write_step(storage, 200, {"w": _w()}, commit=False)
    age_everything(storage.root)
    write_step(storage, 300, {"w": _w()}, commit=False)  # young
    code, out, err = run(capsys, "gc", storage.root, "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["removed_dirs"] == [step_dir(200) + "/"]
    assert doc["skipped_young"] == [step_dir(300)]
    assert (storage.root / step_dir(200)).exists()

    code, out, _ = run(capsys, "gc", storage.root)
    assert code == 0 and "removed" in out and step_dir(200) in out
    assert not (storage.root / step_dir(200)).exists()
    assert (storage.root / step_dir(300)).exists()

    code, out, _ = run(capsys, "gc", storage.root, "--min-age-s", "0", "--json")
    assert json.loads(out)["removed_dirs"] == [step_dir(300) + "/"]
    assert committed_steps(storage) == [100]


def test_usage_errors(storage, capsys):
    _checkpoint(storage, 100)
    code, _, err = run(capsys, "ls", storage.root, "--storage-option", "novalue")
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = run(capsys, "ls", storage.root, "-o", "nonsense=1")
    assert code == 2 and "storage-option" in err and "Traceback" not in err
    code, _, _ = run(capsys, "ls", storage.root, "-o", "fsync=false")
    assert code == 0
    with pytest.raises(SystemExit) as e:
        main(["verify", str(storage.root), "abc"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    code, _, err = run(capsys, "gc", storage.root, "--min-age-s", "-5")
    assert code == 2 and "min-age-s" in err


def test_entry_point_subprocess(storage):
    _checkpoint(storage, 100)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.cli", "verify", str(storage.root), "42"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("shardkeeper: error: step 42 is not committed")
    r = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.cli", "ls", str(storage.root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and "100" in r.stdout


def test_formatting_helpers():
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(5 * 1024**3) == "5.0 GiB"
    assert human_size(None) == "-"
    t = format_table(["A", "NUM"], [["x", 1], ["long", 100]], "lr").splitlines()
    assert t == ["A     NUM", "x       1", "long  100"]


def test_ls_marks_invalid_and_stale_latest(storage, capsys):
    _checkpoint(storage, 100)
    (storage.root / step_dir(200)).mkdir()
    (storage.root / step_dir(200) / "manifest.json").write_bytes(b"[]")
    (storage.root / "LATEST").write_text("200\n")
    code, out, _ = run(capsys, "ls", storage.root)
    assert code == 0
    assert "invalid" in out and "LATEST hint says step 200, which is not committed" in out


def test_cli_on_s3_with_storage_options(s3_root, capsys):
    url, options = s3_root
    from shardkeeper.core.storage import open_storage

    st = open_storage(url, **options)
    _checkpoint(st, 100, world_size=2)
    write_step(st, 200, {"w": _w()}, commit=False)
    opts = [a for k, v in options.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    code, out, err = run(capsys, "verify", url, *opts)
    assert code == 0, err
    assert "step 100: OK" in out
    code, out, _ = run(capsys, "ls", url, *opts, "--json")
    doc = json.loads(out)
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(100, "committed"), (200, "uncommitted")]
    code, out, _ = run(capsys, "gc", url, *opts, "--min-age-s", "0", "--json")
    assert code == 0 and json.loads(out)["removed_dirs"] == [step_dir(200) + "/"]
