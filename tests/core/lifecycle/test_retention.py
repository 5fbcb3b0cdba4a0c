"""Retention and garbage collection, on checkpoints built without torch."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import pytest

from shardkeeper.core.commit.committed import committed_steps, manifest_path
from shardkeeper.core.errors import IncompatibleFormatError, StorageError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.lifecycle.retention import (
    RetentionPolicy,
    apply_retention,
    collect_garbage,
    resolve_file,
    walk_files,
)
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.step import verify_step

try:
    from .._builders import age_everything, set_mtime, tensor, write_step
except ImportError:
    from _builders import age_everything, set_mtime, tensor, write_step


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "run", fsync=False)


def _steps(storage, steps, **kw):
    for s in steps:
        write_step(storage, s, {"model/w": tensor("float32", (4, 3), seed=s)}, **kw)


def _dirs(storage):
    return sorted(n for n in os.listdir(storage.root) if n.startswith("step-"))


# ---------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    "field,value",
    [
        ("keep_last", 0),
        ("keep_last", -2),
        ("keep_every", 0),
        ("keep_every", -1),
        ("keep_last", True),
        ("keep_every", 2.5),
        ("keep_last", "3"),
    ],
)
def test_policy_rejects_bad_values(field, value):
    with pytest.raises(ValueError) as e:
        RetentionPolicy(**{field: value})
    assert field in str(e.value) and repr(value).strip("'") in str(e.value)


@pytest.mark.parametrize("steps", [{1, 2}, frozenset({True}), frozenset({"3"}), [4]])
def test_policy_rejects_bad_keep_steps(steps):
    with pytest.raises(ValueError, match="keep_steps must be a frozenset of ints"):
        RetentionPolicy(keep_last=1, keep_steps=steps)


def test_policy_retained():
    steps = [100, 200, 300, 400, 500]
    assert RetentionPolicy().retained(steps) == set(steps)
    assert RetentionPolicy(keep_last=2).retained(steps) == {400, 500}
    assert RetentionPolicy(keep_last=10).retained(steps) == set(steps)
    assert RetentionPolicy(keep_every=200).retained(steps) == {200, 400}
    assert RetentionPolicy(keep_last=1, keep_every=200).retained(steps) == {200, 400, 500}
    assert RetentionPolicy(keep_last=1).retained([]) == set()
    pinned = RetentionPolicy(keep_last=1, keep_steps=frozenset({200, 999}))
    assert pinned.retained(steps) == {200, 500}
    assert RetentionPolicy(keep_steps=frozenset({200})).retained(steps) == set(steps)  # no count: keep all
    with pytest.raises(dataclasses.FrozenInstanceError):
        RetentionPolicy(keep_last=1).keep_last = 2  # type: ignore[misc]


# ---------------------------------------------------------------------------- apply_retention


def test_keep_last(storage, caplog):
    _steps(storage, [100, 200, 300, 400, 500])
    with caplog.at_level(logging.INFO, logger="shardkeeper.core.lifecycle.retention"):
        assert apply_retention(storage, RetentionPolicy(keep_last=2)) == [100, 200, 300]
    assert committed_steps(storage) == [400, 500]
    assert _dirs(storage) == [step_dir(400), step_dir(500)]
    assert "deleted step 100" in caplog.text
    assert apply_retention(storage, RetentionPolicy(keep_last=2)) == []


def test_keep_steps_pins_a_step(storage):
    _steps(storage, [100, 200, 300, 400])
    assert apply_retention(storage, RetentionPolicy(keep_last=1, keep_steps=frozenset({200}))) == [100, 300]
    assert committed_steps(storage) == [200, 400]
    assert _dirs(storage) == [step_dir(200), step_dir(400)]


def test_keep_every_and_newest(storage):
    _steps(storage, [100, 200, 300, 400, 500])
    assert apply_retention(storage, RetentionPolicy(keep_every=200)) == [100, 300]
    assert committed_steps(storage) == [200, 400, 500]  # 500: the newest, always kept


def test_newest_is_never_deleted(storage):
    _steps(storage, [100, 200, 300])
    assert apply_retention(storage, RetentionPolicy(keep_every=1000)) == [100, 200]
    assert committed_steps(storage) == [300]


def test_no_policy_keeps_everything(storage):
    _steps(storage, [1, 2, 3])
    assert apply_retention(storage, RetentionPolicy()) == []
    assert committed_steps(storage) == [1, 2, 3]


def test_empty_root(storage):
    assert apply_retention(storage, RetentionPolicy(keep_last=1)) == []


def test_protect(storage):
    _steps(storage, [100, 200, 300, 400])
    # An in-flight save (uncommitted) and a committed step a running save depends on.
    write_step(storage, 500, {"model/w": tensor("float32", (4, 3))}, commit=False)
    assert apply_retention(storage, RetentionPolicy(keep_last=1), protect=[200, 500]) == [100, 300]
    assert committed_steps(storage) == [200, 400]
    assert step_dir(500) in _dirs(storage)  # never touched
    assert walk_files(storage, step_dir(500))


def test_reference_aware_deletion(storage):
    # Step 100: "a" on rank 0's file, "b" on rank 1's. Step 200 references 100's "a" chunks.
    write_step(
        storage,
        100,
        {"a": tensor("float32", (4, 4), 1), "b": tensor("int64", (3,), 2)},
        world_size=2,
        placement={"a": 0, "b": 1},
    )
    write_step(storage, 200, {"c": tensor("float16", (5,), 3)}, reuse={"a": 100})
    ref = resolve_file(200, "../" + step_dir(100) + "/data/x")
    assert ref == f"{step_dir(100)}/data/x"

    assert apply_retention(storage, RetentionPolicy(keep_last=1)) == [100]
    assert committed_steps(storage) == [200]
    assert not storage.exists(manifest_path(100))  # no longer committed
    left = walk_files(storage, step_dir(100))
    assert len(left) == 1 and "/r00000-" in left[0]  # rank 0's file ("a"), referenced: kept
    assert verify_step(storage, 200).ok

    # gc must not remove files retained steps reference, even in an uncommitted dir.
    age_everything(storage.root)
    report = collect_garbage(storage, min_age_s=60)
    assert report.removed_paths == [] and report.kept_referenced == left
    assert verify_step(storage, 200).ok

    # Once 200 is gone too, 100's leftover is garbage.
    write_step(storage, 300, {"c": tensor("float16", (5,), 4)})
    assert apply_retention(storage, RetentionPolicy(keep_last=1)) == [200]
    assert _dirs(storage) == [step_dir(100), step_dir(300)]
    age_everything(storage.root)
    report = collect_garbage(storage, min_age_s=60)
    assert report.removed_dirs == [step_dir(100) + "/"]
    assert report.removed_bytes > 0
    assert _dirs(storage) == [step_dir(300)]


class _Recording:
    """Delegates to a LocalStorage, records deletions, fails on request."""

    def __init__(self, inner, fail_delete=(), fail_delete_dir=()):
        self._inner = inner
        self.log: list[tuple[str, str]] = []
        self.fail_delete = set(fail_delete)
        self.fail_delete_dir = set(fail_delete_dir)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def delete(self, path):
        if path in self.fail_delete:
            raise StorageError(f"injected failure deleting {path}")
        self.log.append(("delete", path))
        self._inner.delete(path)

    def delete_dir(self, path):
        if path in self.fail_delete_dir:
            raise StorageError(f"injected failure deleting {path}")
        self.log.append(("delete_dir", path))
        self._inner.delete_dir(path)


def test_manifest_goes_first_and_newer_steps_first(storage):
    write_step(storage, 100, {"a": tensor("float32", (4,), 1)})
    write_step(storage, 200, {"b": tensor("float32", (4,), 2)}, reuse={"a": 100})
    write_step(storage, 300, {"c": tensor("float32", (4,), 3)})
    rec = _Recording(storage)
    assert apply_retention(rec, RetentionPolicy(keep_last=1)) == [100, 200]
    # Every doomed manifest first, newest first (200 references 100), then the commits in
    # progress are read, then the directories: no committed manifest ever points at deleted
    # bytes, and a commit that references a deleted step sees its manifest gone.
    assert rec.log == [
        ("delete", manifest_path(200)),
        ("delete", manifest_path(100)),
        ("delete_dir", step_dir(200)),
        ("delete_dir", step_dir(100)),
    ]
    assert _dirs(storage) == [step_dir(300)]


def test_failure_on_one_step_continues(storage, caplog):
    _steps(storage, [100, 200, 300, 400])
    rec = _Recording(storage, fail_delete={manifest_path(200)}, fail_delete_dir={step_dir(100)})
    with caplog.at_level(logging.INFO, logger="shardkeeper.core.lifecycle.retention"):
        deleted = apply_retention(rec, RetentionPolicy(keep_last=1))
    # 200's manifest could not be deleted: still committed. 100's manifest went, its data
    # did not: uncommitted, reported, left to gc.
    assert deleted == [100, 300]
    assert committed_steps(storage) == [200, 400]
    assert step_dir(100) in _dirs(storage)
    assert "could not delete the manifest of step 200" in caplog.text
    assert "gc" in caplog.text
    age_everything(storage.root)
    assert collect_garbage(storage, min_age_s=60).removed_dirs == [step_dir(100) + "/"]


def test_retention_refuses_with_newer_format(storage, caplog):
    _steps(storage, [100, 200])
    (storage.root / step_dir(300)).mkdir()
    (storage.root / step_dir(300) / "manifest.json").write_text('{"format_version": 99, "step": 300}')
    assert committed_steps(storage) == [100, 200, 300]  # a newer format still counts
    assert apply_retention(storage, RetentionPolicy(keep_last=1)) == []
    assert committed_steps(storage) == [100, 200, 300]
    with pytest.raises(IncompatibleFormatError):
        collect_garbage(storage, min_age_s=0)


# ---------------------------------------------------------------------------- collect_garbage


def test_gc_uncommitted_dirs_old_and_young(storage):
    _steps(storage, [100])
    write_step(storage, 200, {"w": tensor("float32", (8,))}, commit=False)  # failed save
    write_step(storage, 300, {"w": tensor("float32", (8,))}, commit=False)  # still running
    set_mtime(storage.root, step_dir(200), time.time() - 3600)
    set_mtime(storage.root, step_dir(300), time.time() - 3600)
    os.utime(storage.root / walk_files(storage, step_dir(300))[0])  # one file just written

    dry = collect_garbage(storage, min_age_s=900, dry_run=True)
    assert dry.removed_dirs == [step_dir(200) + "/"] and dry.dry_run
    assert step_dir(200) in _dirs(storage)  # dry run removed nothing

    report = collect_garbage(storage, min_age_s=900)
    assert report.removed_dirs == [step_dir(200) + "/"]
    assert report.removed_bytes == dry.removed_bytes > 0
    assert report.skipped_young == [step_dir(300)]
    assert _dirs(storage) == [step_dir(100), step_dir(300)]
    assert committed_steps(storage) == [100]
    # `now` moves the clock instead of the files.
    later = collect_garbage(storage, min_age_s=900, now=time.time() + 901)
    assert later.removed_dirs == [step_dir(300) + "/"]


def test_gc_files_in_committed_dirs(storage):
    write_step(storage, 100, {"w": tensor("float32", (4, 4))}, world_size=2)
    data = storage.root / step_dir(100) / "data"
    loser = data / "r00000-deadbeef-000.safetensors"  # a losing writer's attempt
    loser.write_bytes(b"x" * 100)
    tmp = storage.root / step_dir(100) / ".manifest.json.123.456.tmp"
    tmp.write_bytes(b"{}")
    young = data / "r00001-cafecafe-000.safetensors"
    young.write_bytes(b"y" * 10)
    old = time.time() - 3600
    for p in (loser, tmp):
        os.utime(p, (old, old))
    report = collect_garbage(storage, min_age_s=900)
    assert sorted(report.removed_files) == sorted([f"{step_dir(100)}/data/{loser.name}", f"{step_dir(100)}/{tmp.name}"])
    assert report.removed_bytes == 102
    assert report.skipped_young == [f"{step_dir(100)}/data/{young.name}"]
    assert young.exists() and not loser.exists() and not tmp.exists()
    assert verify_step(storage, 100).ok  # referenced files and the manifest untouched


def test_gc_torn_manifest_and_foreign_names(storage):
    _steps(storage, [100])
    torn = storage.root / step_dir(200)
    torn.mkdir()
    (torn / "manifest.json").write_bytes(b'{"format_version": 1, "ste')
    for name in ("notes.txt", "step-12", "step-000000000300.bak", "other"):
        p = storage.root / name
        if name == "other":
            p.mkdir()
            (p / "f").write_bytes(b"1")
        else:
            p.write_bytes(b"keep me")
    age_everything(storage.root)
    report = collect_garbage(storage, min_age_s=1)
    assert report.removed_dirs == [step_dir(200) + "/"]
    assert report.removed_files == []
    for name in ("notes.txt", "step-12", "step-000000000300.bak", "other", "LATEST"):
        assert (storage.root / name).exists(), name
    assert committed_steps(storage) == [100]


def test_gc_empty_dir_and_bad_age(storage):
    (storage.root / step_dir(5)).mkdir(parents=True)
    assert collect_garbage(storage, min_age_s=900).skipped_young == [step_dir(5)]
    set_mtime(storage.root, step_dir(5), time.time() - 1000)
    assert collect_garbage(storage, min_age_s=900).removed_dirs == [step_dir(5) + "/"]
    with pytest.raises(ValueError, match="min_age_s"):
        collect_garbage(storage, min_age_s=-1)


def test_gc_on_missing_root(tmp_path):
    report = collect_garbage(LocalStorage(tmp_path / "nothing"), min_age_s=0)
    assert report.removed_paths == [] and report.errors == []


def test_gc_leaves_non_canonical_step_names_alone(storage):
    _steps(storage, [100])
    odd = storage.root / "step-0000000000007"  # parses as step 7, but not the canonical name
    odd.mkdir()
    (odd / "manifest.json").write_bytes(b"{}")
    age_everything(storage.root)
    report = collect_garbage(storage, min_age_s=1)
    assert report.removed_paths == [] and odd.exists()


def test_on_any_backend(storage_root):
    """Retention, gc and verify through the storage protocol only (local and S3 via moto)."""
    st = storage_root.open()
    write_step(
        st,
        100,
        {"a": tensor("float32", (4, 4), 1), "b": tensor("int64", (3,), 2)},
        world_size=2,
        placement={"a": 0, "b": 1},
    )
    write_step(st, 200, {"c": tensor("float16", (5,), 3)}, reuse={"a": 100})
    write_step(st, 300, {"c": tensor("float16", (5,), 4)}, commit=False)
    assert apply_retention(st, RetentionPolicy(keep_last=1)) == [100]
    assert committed_steps(st) == [200] and verify_step(st, 200).ok
    assert len(walk_files(st, step_dir(100))) == 1
    assert collect_garbage(st, min_age_s=900).removed_paths == []
    report = collect_garbage(st, min_age_s=900, now=time.time() + 3600)
    assert report.removed_dirs == [step_dir(300) + "/"]
    assert len(report.kept_referenced) == 1 and verify_step(st, 200).ok


def test_memory_backend_cli(capsys):
    import uuid

    from shardkeeper.core.cli import main
    from shardkeeper.core.storage import open_storage

    url = f"memory://sk-{uuid.uuid4().hex}/run"
    st = open_storage(url)
    write_step(st, 100, {"model/w": tensor("float32", (4, 3), 1)})
    assert main(["verify", url]) == 0
    assert "step 100: OK" in capsys.readouterr().out
    assert main(["ls", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(100, "committed")]
