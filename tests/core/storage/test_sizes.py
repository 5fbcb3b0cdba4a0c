"""Sizes of many files in one call (``storage.base.sizes_of``): the answers ``size`` gives.

Commit checks ask the size of every file a group or a manifest lists (256 files per group
leader at the default ``commit_group_ranks``). On local disk ``LocalStorage.sizes`` opens
each directory once beneath the root and asks one ``fstatat`` a file, instead of a walk of
``lstat`` calls per path; whatever is not a plain regular file in such a directory is asked
of ``size`` itself. These tests hold the batch to ``size``'s answers on every kind of entry
the local rules name, and wrappers to their own ``size``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkeeper.core.commit.put import check_files
from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from shardkeeper.core.storage import LocalStorage, beneath
from shardkeeper.core.storage.base import size_or_missing, sizes_of
from shardkeeper.core.storage.local_paths import RootPaths
from shardkeeper.core.storage.retry import RetryingStorage, RetryPolicy
from shardkeeper.core.storage.wrapper import StorageWrapper
from shardkeeper.core.testing.faults import FaultyStorage

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.005, deadline_s=10.0)


def _tree(tmp_path: Path) -> tuple[LocalStorage, list[str]]:
    """A root with every kind of entry the local rules distinguish; the paths to ask about."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    data = root / "step-1" / "data"
    data.mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 99)
    for i in range(5):
        (data / f"r{i}.safetensors").write_bytes(b"x" * (10 + i))
    (root / "LATEST").write_bytes(b"7")
    os.symlink("r1.safetensors", data / "inside-link")  # stays inside: followed
    os.symlink(str(outside / "secret"), data / "leaving-link")  # leaves: its own entry
    os.symlink("nowhere", data / "dangling-link")
    os.mkfifo(data / "fifo")
    (data / "a-directory").mkdir()
    os.symlink("data", root / "step-1" / "via")  # a directory link inside the root
    paths = [
        *(f"step-1/data/r{i}.safetensors" for i in range(5)),
        "step-1/data/missing",
        "step-1/nodir/missing",
        "LATEST",
        "step-1/data/inside-link",
        "step-1/data/leaving-link",
        "step-1/data/dangling-link",
        "step-1/data/fifo",
        "step-1/data/a-directory",
        "step-1/via/r2.safetensors",
        "step-1/data/..",
        "step-1/data/.",
    ]
    return LocalStorage(root), paths


def test_sizes_answer_as_size_does_for_every_kind_of_entry(tmp_path: Path) -> None:
    storage, paths = _tree(tmp_path)
    want = [size_or_missing(storage, p) for p in paths]
    assert want[:7] == [10, 11, 12, 13, 14, -1, -1]  # (the tree is what the test means)
    assert storage.sizes(paths) == want
    assert sizes_of(storage, paths) == want
    assert storage.sizes([]) == []


def test_sizes_of_a_path_through_a_link_leaving_the_root_is_refused_as_size_is(tmp_path: Path) -> None:
    storage, paths = _tree(tmp_path)
    os.symlink(str(tmp_path / "outside"), storage.root / "step-1" / "out")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        storage.size("step-1/out/secret")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        storage.sizes([paths[0], "step-1/out/secret"])


def test_regular_files_take_one_fstatat_not_a_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch answers plain files (and missing ones) without the per-path walk."""
    storage, paths = _tree(tmp_path)

    def no_walk(self: RootPaths, path: str) -> os.stat_result:
        raise AssertionError(f"walked {path}")

    monkeypatch.setattr(RootPaths, "stat", no_walk)
    assert storage.sizes(paths[:6]) == [10, 11, 12, 13, 14, -1]


def test_without_openat2_every_path_is_asked_of_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage, paths = _tree(tmp_path)
    want = [size_or_missing(storage, p) for p in paths]
    monkeypatch.setattr(beneath, "_syscall", None)  # (an old kernel, another OS, a seccomp filter)
    calls: list[str] = []
    walk = RootPaths.stat

    def counted(self: RootPaths, path: str) -> os.stat_result:
        calls.append(path)
        return walk(self, path)

    monkeypatch.setattr(RootPaths, "stat", counted)
    assert storage.sizes(paths) == want
    assert sorted(calls) == sorted(paths)


def test_a_wrapper_that_changes_size_answers_through_its_own(tmp_path: Path) -> None:
    storage, paths = _tree(tmp_path)

    class Padded(StorageWrapper):
        def size(self, path: str) -> int:
            return self.inner.size(path) + 1000

    class Plain(StorageWrapper):
        pass

    want = [size_or_missing(storage, p) for p in paths]
    assert sizes_of(Padded(storage), paths[:5]) == [w + 1000 for w in want[:5]]
    assert sizes_of(Plain(storage), paths) == want

    faulty = FaultyStorage(storage, fail_on={"size": "*r3*"})
    with pytest.raises(OSError, match="injected fault"):
        sizes_of(faulty, paths[:5])
    assert faulty.injected == [("size", "step-1/data/r3.safetensors")]


def test_retries_take_the_batch_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage, paths = _tree(tmp_path)
    flaky = RetryingStorage(FaultyStorage(storage, fail_on={"size": "*r2*"}, error=ConnectionResetError, times=2), FAST)
    assert sizes_of(flaky, paths[:6]) == [10, 11, 12, 13, 14, -1]
    assert flaky.retries == 2
    plain = RetryingStorage(storage, FAST)  # the manager's stack on local disk keeps the fast path
    monkeypatch.setattr(RootPaths, "stat", lambda self, path: pytest.fail(f"walked {path}"))
    assert sizes_of(plain, paths[:6]) == [10, 11, 12, 13, 14, -1]


def test_check_files_names_the_file_a_batch_found_wrong(tmp_path: Path) -> None:
    storage, paths = _tree(tmp_path)
    own = {p: {"size_bytes": 10 + i, "rank": i} for i, p in enumerate(paths[:5])}
    check_files(storage, own, dict.fromkeys(own, 0))  # all there, at their sizes
    os.truncate(storage.root / paths[3], 2)
    with pytest.raises(CorruptCheckpointError, match=r"r3.safetensors \(written by rank 3\) is 2 bytes"):
        check_files(storage, own, dict.fromkeys(own, 0))
    os.remove(storage.root / paths[1])
    with pytest.raises(CorruptCheckpointError, match=r"r1.safetensors \(written by rank 1\) is missing"):
        check_files(storage, own, dict.fromkeys(own, 0))
    with pytest.raises(CheckpointNotFoundError):
        storage.size(paths[1])


def test_a_size_replaced_by_a_subclass_or_on_the_instance_answers(tmp_path: Path) -> None:
    """A batch answers only for the ``size`` it was written for: a subclass's own ``size``
    (of the local storage, of the retrying wrapper) or one set on the instance answers."""
    storage, paths = _tree(tmp_path)

    class Failing(LocalStorage):
        def size(self, path: str) -> int:
            raise StorageError(f"no size of {path}")

    class Padded(RetryingStorage):
        def size(self, path: str) -> int:
            return self.inner.size(path) + 1000

    with pytest.raises(StorageError, match="no size of"):
        sizes_of(Failing(storage.root), paths[:2])
    assert sizes_of(Padded(storage, FAST), paths[:2]) == [1010, 1011]
    plain = StorageWrapper(storage)
    plain.size = lambda path: 7  # type: ignore[method-assign]
    assert sizes_of(plain, paths[:2]) == [7, 7]
    storage.size = lambda path: 8  # type: ignore[method-assign]
    assert sizes_of(storage, paths[:2]) == [8, 8]


def test_a_name_that_cannot_be_encoded_fails_as_size_fails(tmp_path: Path) -> None:
    """A lone surrogate (valid JSON, no file name) in a directory: the path goes to ``size``,
    so the first bad path in order raises what ``size`` raises for it."""
    storage, paths = _tree(tmp_path)
    bad = ["step-1/data/r0.safetensors/x", "\ud800/y"]
    with pytest.raises(Exception) as by_size:
        [size_or_missing(storage, p) for p in bad]
    with pytest.raises(Exception) as by_batch:
        storage.sizes(bad)
    assert type(by_batch.value) is type(by_size.value) and str(by_batch.value) == str(by_size.value)
