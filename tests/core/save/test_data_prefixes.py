"""Hashed data prefixes: a save's files spread over subdirectories of ``data/`` (``data_prefixes``)
restore, verify, and are listed, kept and deleted by retention and gc like flat ones, on local
disk and on the object stores; incremental references into them resolve."""

from __future__ import annotations

import os
import time

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.files import walk_files
from shardkeeper.core.format.layout import data_dir, data_prefixes, shard_file, step_dir
from shardkeeper.core.lifecycle.gc import collect_garbage
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify.step import verify_step


def test_default_prefixes_grow_with_the_world() -> None:
    assert [data_prefixes(None, w) for w in (1, 64, 65, 512, 1024, 16384, 1 << 20)] == [1, 1, 2, 8, 16, 256, 4096]
    assert data_prefixes(3, 16384) == 3
    assert shard_file(5, "abcd1234", 0) == "data/r00005-abcd1234-000.safetensors"
    spread = {data_dir(r, 16) for r in range(256)}
    assert len(spread) == 16 and all(p.startswith("data/") and len(p) == len("data/0") for p in spread)
    assert len({data_dir(r, 256) for r in range(4096)}) == 256  # two hex digits, every one used


def test_a_bad_prefix_count_is_refused() -> None:
    for bad in (0, 4097, -1):
        with pytest.raises(ValueError, match="data_prefixes must be between 1 and 4096"):
            CheckpointManager("/nonexistent-never-created", data_prefixes=bad)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64, 32), v), "b": torch.arange(10.0) + v}}


def test_nested_files_restore_verify_and_are_deleted_by_retention_and_gc(storage_root) -> None:
    url, opts = storage_root.url, storage_root.options
    with CheckpointManager(url, storage_options=opts, data_prefixes=16, keep_last=1) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
        storage = mgr._ctx.storage
        files = walk_files(storage, step_dir(1))
        nested = [f for f in files if f.count("/") == 3]  # step-.../data/<hex>/file
        assert nested and all(f.split("/")[2] == data_dir(0, 16).split("/")[1] for f in nested), files
        assert not verify_step(storage, 1).problems
        mgr.save(2, _state(2.0), async_save=False)  # keep_last=1: step 1 goes, nested files and all
        assert walk_files(storage, step_dir(1)) == []
        target = _state(0.0)
        assert mgr.restore(target) == 2
        assert torch.equal(target["model"]["w"], torch.full((64, 32), 2.0))
    # An abandoned save's nested files are garbage; the committed step's stay.
    storage = open_storage(url, **opts)
    leftover = f"{step_dir(3)}/data/{data_dir(7, 16).split('/')[1]}/r00007-0badf00d-000.safetensors"
    storage.put(leftover, b"x" * 100)
    report = collect_garbage(storage, min_age_s=0.0, now=time.time() + 3600)
    assert step_dir(3) + "/" in report.removed_dirs, report
    assert walk_files(storage, step_dir(3)) == []
    assert walk_files(storage, step_dir(2)) and not verify_step(storage, 2).problems


def test_gc_reports_an_empty_prefix_directory_as_a_directory_of_no_bytes(tmp_path) -> None:
    """An empty ``data/<prefix>/`` left in a committed step (a losing writer's, or one emptied
    by hand) is removed as a directory; gc used to report it among the removed files with the
    directory's own size (4096 bytes on ext4) counted as removed bytes."""
    with CheckpointManager(tmp_path, data_prefixes=16) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
    empty = tmp_path / step_dir(1) / "data" / "e"
    empty.mkdir()
    stray = tmp_path / step_dir(1) / "data" / "0" / "r00009-0badf00d-000.safetensors"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"y" * 123)
    storage = open_storage(str(tmp_path))
    for dry_run in (True, False):
        report = collect_garbage(storage, min_age_s=0.0, now=time.time() + 3600, dry_run=dry_run)
        assert report.removed_dirs == [f"{step_dir(1)}/data/e/"], report
        assert report.removed_files == [f"{step_dir(1)}/data/0/r00009-0badf00d-000.safetensors"], report
        assert report.removed_bytes == 123 and not report.errors, report
    assert not empty.exists() and not stray.exists()
    assert not verify_step(storage, 1).problems


def test_gc_leaves_a_tree_deeper_than_any_layout_alone(tmp_path) -> None:
    """A directory with entries nine levels down a committed step was listed as one entry and
    removed whole by its own (old) mtime, fresh files and all, as "an empty directory"."""
    with CheckpointManager(tmp_path, data_prefixes=16) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
    deep = tmp_path / step_dir(1) / "a" / "b" / "c" / "d" / "e" / "f" / "g" / "h" / "i"
    (deep / "j").mkdir(parents=True)
    (deep / "j" / "fresh.bin").write_bytes(b"z" * 5000)
    (deep / "fresh2.bin").write_bytes(b"z" * 3000)
    old = time.time() - 3 * 3600
    os.utime(deep, (old, old))
    report = collect_garbage(open_storage(str(tmp_path)))
    assert not report.removed_dirs and not report.removed_files and not report.errors, report
    assert (deep / "j" / "fresh.bin").exists() and (deep / "fresh2.bin").exists()
    # In a directory no manifest commits, gc judges by the newest file: one it cannot see (below
    # the walk's depth) must not let an old shallow file decide that a writer is gone.
    leftover = tmp_path / step_dir(5)
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "r00000-0badf00d-000.safetensors").write_bytes(b"o" * 10)
    os.utime(leftover / "data" / "r00000-0badf00d-000.safetensors", (old, old))
    hidden = leftover / "a" / "b" / "c" / "d" / "e" / "f" / "g" / "h" / "i" / "j"
    hidden.mkdir(parents=True)
    (hidden / "fresh.bin").write_bytes(b"f" * 10)
    report = collect_garbage(open_storage(str(tmp_path)))
    assert not report.removed_dirs and not report.removed_files, report
    assert (hidden / "fresh.bin").exists()


def test_gc_walks_into_a_directory_named_like_a_data_file(tmp_path) -> None:
    """A directory named ``*.safetensors`` was taken for a file: gc's dry run said it would
    remove a file of 4096 bytes, and every real run failed on it (exit 1), calling the step
    damaged."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
    data = tmp_path / step_dir(1) / "data"
    (data / "junk.safetensors").mkdir()
    (data / "junk.safetensors" / "inner.bin").write_bytes(b"q" * 700)
    (data / "empty.safetensors").mkdir()
    storage = open_storage(str(tmp_path))
    reports = [collect_garbage(storage, min_age_s=0.0, now=time.time() + 3600, dry_run=dry) for dry in (True, False)]
    for report in reports:
        assert report.removed_files == [f"{step_dir(1)}/data/junk.safetensors/inner.bin"], report
        assert report.removed_dirs == [f"{step_dir(1)}/data/empty.safetensors/"], report
        assert report.removed_bytes == 700 and not report.errors, report
    assert not (data / "empty.safetensors").exists() and not (data / "junk.safetensors" / "inner.bin").exists()
    assert not verify_step(storage, 1).problems


def test_gc_counts_no_bytes_for_a_link_it_removes(tmp_path) -> None:
    """Removing a link frees none of what it points at: gc counted the target's size (a
    directory's 4096 bytes, a whole data file's)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
        mgr.save(2, _state(2.0), async_save=False)
    (data,) = (tmp_path / step_dir(2) / "data").iterdir()
    (tmp_path / step_dir(1) / "to-a-dir").symlink_to(f"../{step_dir(2)}/data")
    (tmp_path / step_dir(1) / "to-a-file").symlink_to(f"../{step_dir(2)}/data/{data.name}")
    report = collect_garbage(open_storage(str(tmp_path)), min_age_s=0.0)
    assert sorted(report.removed_files) == [f"{step_dir(1)}/to-a-dir", f"{step_dir(1)}/to-a-file"], report
    assert report.removed_bytes == 0 and not report.errors, report
    assert data.exists() and not verify_step(open_storage(str(tmp_path)), 2).problems


def test_folder_markers_are_neither_files_nor_gc_failures(storage_root, capsys) -> None:
    """A console or a sync tool leaves zero-byte "folder" objects (``step-N/``,
    ``step-N/data/7/``) on an object store. They are no file of any step: gc used to fail on
    them every run (exit 1, "mtime failed ... IsADirectoryError") and never removed them."""
    import json

    from shardkeeper.core.cli import main

    if storage_root.url.startswith("/"):
        pytest.skip("object stores only (local disk: an empty directory, tested above)")
    url, opts = storage_root.url, storage_root.options
    with CheckpointManager(url, storage_options=opts, data_prefixes=16) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
        mgr.save(2, _state(2.0), async_save=False)
    storage = open_storage(url, **opts)
    for marker in (f"{step_dir(2)}/", f"{step_dir(2)}/data/7/", f"{step_dir(9)}/"):
        storage.fs.pipe(f"{storage.root}/{marker}", b"")
    storage.fs.invalidate_cache()
    argv = [a for k, v in opts.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    for run in range(2):
        code = main(["gc", url, "--min-age-s", "0", "--json", *argv])
        out = capsys.readouterr().out
        assert code == 0, out
        doc = json.loads(out)
        assert not doc["errors"] and not doc["removed_files"], doc
        gone = [] if run else [f"{step_dir(2)}/data/7/", f"{step_dir(9)}/"]  # the next run: nothing again
        assert doc["removed_dirs"] == gone, doc
    storage.fs.invalidate_cache()
    left = storage.fs.find(storage.root, withdirs=False)
    assert not [k for k in left if k.endswith("/data/7/") or step_dir(9) in k], left
    assert not verify_step(storage, 2).problems
    with CheckpointManager(url, storage_options=opts) as mgr:
        assert mgr.steps() == [1, 2]
        target = _state(0.0)
        assert mgr.restore(target) == 2 and torch.equal(target["model"]["w"], torch.full((64, 32), 2.0))


def test_incremental_references_into_prefixed_files(tmp_path) -> None:
    root = str(tmp_path / "r")
    with CheckpointManager(root, data_prefixes=4, incremental=True) as mgr:
        mgr.save(1, _state(1.0), async_save=False)
        state = _state(1.0)
        state["model"]["b"] = torch.arange(10.0) + 5  # changed; w is stored as a reference
        mgr.save(2, state, async_save=False)
        target = _state(0.0)
        mgr.restore(target, step=2)
        assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(
            target["model"]["b"], state["model"]["b"]
        )
    man = open(os.path.join(root, step_dir(2), "manifest.json")).read()
    assert f"../{step_dir(1)}/data/" in man


def test_files_under_hashed_prefixes_are_encrypted(tmp_path, monkeypatch) -> None:
    """Every file under a step's data/, at any depth, is an encrypted file: a prefix
    directory is no way around the encryption (it once was)."""
    import base64

    monkeypatch.setenv("SK_PREFIX_KEK", base64.b64encode(bytes(range(32))).decode())
    root = tmp_path / "r"
    secret = torch.arange(4096, dtype=torch.float32)
    with CheckpointManager(root, encryption="env:SK_PREFIX_KEK", data_prefixes=4) as mgr:
        mgr.save(1, {"secret": secret}, async_save=False)
        files = [p for p in (root / step_dir(1) / "data").rglob("*") if p.is_file()]
        assert files and all(p.parent.name != "data" for p in files)  # all in a prefix directory
        for p in files:
            raw = p.read_bytes()
            assert raw.startswith(b"SKCRYPT1") and secret.numpy().tobytes()[:64] not in raw, p
        target = {"secret": torch.zeros(4096)}
        mgr.restore(target)
        assert torch.equal(target["secret"], secret)
