"""A persist lock is the file at its path: a waiter that clears a stale lock file never
removes a newer holder's, and a save never holds a lock on a file a waiter just removed
(either would let a restore choose an older step while a newer one still commits)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core.errors import CheckpointTimeoutError
from shardkeeper.core.persist import locks

ROOT, NS = "/a/root", "shardkeeper/aa"


def _between_open_and_flock(monkeypatch: pytest.MonkeyPatch, meanwhile: Any) -> None:
    """Run ``meanwhile()`` once, right before the next ``flock`` (its own flocks pass through)."""
    real, pending = fcntl.flock, [meanwhile]

    def flock(fd: int, op: int) -> None:
        if pending:
            pending.pop()()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_clearing_a_released_lock_leaves_the_new_holders_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    old_fd, path = locks.hold(ROOT, NS, 0, 5)
    held: list[int] = []

    def released_then_taken_again() -> None:  # the save ends; the same step is saved again
        locks.release(old_fd, path)
        held.append(locks.hold(ROOT, NS, 0, 5)[0])

    with pytest.MonkeyPatch.context() as mp:
        _between_open_and_flock(mp, released_then_taken_again)
        locks.clear_if_free(path)
    try:
        assert path.exists(), "a waiter removed the lock file of the save that holds it now"
        with pytest.raises(CheckpointTimeoutError):
            locks.wait_for_commits(ROOT, "", 0.1, rank=0)
    finally:
        locks.release(held[0], path)


def test_a_lock_is_never_held_on_a_file_a_waiter_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    fd, path = locks.hold(ROOT, NS, 0, 5)
    os.close(fd)  # its processes died: a stale file at the path the next save of step 5 takes
    with pytest.MonkeyPatch.context() as mp:
        _between_open_and_flock(mp, lambda: locks.clear_if_free(path))
        fd, path = locks.hold(ROOT, NS, 0, 5)
    try:
        assert path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)), "the lock is on a removed file"
        with pytest.raises(CheckpointTimeoutError):
            locks.wait_for_commits(ROOT, "", 0.1, rank=0)
    finally:
        locks.release(fd, path)
