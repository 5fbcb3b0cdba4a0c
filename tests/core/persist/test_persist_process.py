"""``writer="process"`` on one rank: every codec and staging mode through a persist process,
bit for bit; a persist process that dies fails its save loudly and the next save goes on;
nothing is left behind; inputs it cannot serve are refused up front."""

from __future__ import annotations

import base64
import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CheckpointSaveError, LocalKeyProvider, metrics
from tests.checks import assert_same_state

pytestmark = pytest.mark.timeout(300)


def _state(step: int, n: int = 1 << 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(n, generator=g),
        "mask": (torch.rand(n, generator=g) > 0.9).float(),  # compresses
        "frozen": torch.arange(4096, dtype=torch.float64),  # the same every step: incremental reuses it
        "ids": torch.arange(step, step + 100, dtype=torch.int64),
    }


class _UserKeys(LocalKeyProvider):
    """A key provider of the user's own."""


def _staging_maps() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "shardkeeper-staging" in line]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"incremental": True, "compression": "zstd"},
        {"encryption": "env:SK_TEST_PERSIST_KEY"},
        {"staging": "overlap"},
        {"async_save": False},
    ],
    ids=["plain", "codecs", "encrypted", "overlap", "sync"],
)
def test_saves_through_a_persist_process_restore_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    monkeypatch.setenv("SK_TEST_PERSIST_KEY", base64.b64encode(bytes(range(32))).decode())
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    root = str(tmp_path / "root")
    live = _state(1)
    written = metrics.BYTES_WRITTEN.total()
    with CheckpointManager(root, writer="process", **options) as mgr:
        for step in (1, 2, 3):
            for k, v in _state(step).items():
                live[k].copy_(v)
            mgr.save(step, {"s": live})  # back to back: the previous save may still be committing
            live["w"].add_(1000.0)  # changed right after save() returned: the save keeps the staged bytes
        pid = mgr._saver.pid
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]
    assert metrics.BYTES_WRITTEN.total() > written  # the persist process's counts reach the trainer's metrics
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # close() ended it
    for step in (1, 2, 3):
        target = {"s": {k: torch.zeros_like(v) for k, v in _state(step).items()}}
        with CheckpointManager(root, **{k: v for k, v in options.items() if k == "encryption"}) as mgr:
            assert mgr.restore(target, step=step) == step
        assert_same_state(target["s"], _state(step), what=f"step {step}")
    if options.get("incremental"):
        with CheckpointManager(root) as mgr:
            files = {c.file for c in mgr.manifest(3).leaves["s/frozen"].chunks}
        assert all(f.startswith("../step-000000000001/") for f in files), files
    assert not list((tmp_path / "locks").glob("*.lock"))
    del mgr, target
    gc.collect()
    assert _staging_maps() == [], "the shared staging buffer outlived its managers"


def test_a_persist_process_killed_mid_save_fails_it_loudly_and_the_next_save_goes_on(tmp_path: Path) -> None:
    """The first save's persist process is killed while it starts: that save raises, naming
    the rank, the step and the signal; the next save starts a new process and commits."""
    root = str(tmp_path / "root")
    with CheckpointManager(root, writer="process") as mgr:
        h = mgr.save(1, {"s": _state(1)})
        pid = mgr._saver.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CheckpointSaveError) as caught:
            h.wait()
        text = str(caught.value)
        assert "step 1" in text and "rank 0" in text and "SIGKILL" in text and str(pid) in text, text
        assert f"under {root}" in text, text
        mgr.save(2, {"s": _state(2)}).wait()
        assert mgr._saver.pid not in (None, pid)
        assert mgr.steps() == [2]
    target = {"s": {k: torch.zeros_like(v) for k, v in _state(2).items()}}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(target) == 2
    assert_same_state(target["s"], _state(2), what="step 2")


def test_a_stopped_persist_process_bounds_the_wait_for_its_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persist process that stops answering (SIGSTOP: as a hung one) makes ``wait()`` raise
    ``CheckpointTimeoutError`` after 2 x commit_timeout_s (+ a slack, shortened here), naming
    the step, the root, the rank and the process; once it goes on, the step commits and the
    next save goes on with the same process (before, ``wait()`` blocked for good)."""
    from shardkeeper.core import CheckpointTimeoutError
    from shardkeeper.core.persist import client

    monkeypatch.setattr(client, "OUTCOME_SLACK_S", 1.0)
    root = str(tmp_path / "root")
    with CheckpointManager(root, writer="process", commit_timeout_s=1.0) as mgr:
        mgr.save(1, {"s": _state(1)}).wait()
        pid = mgr._saver.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(CheckpointTimeoutError) as caught:
                mgr.save(2, {"s": _state(2)}).wait()
            assert time.monotonic() - t0 < 30
        finally:
            os.kill(pid, signal.SIGCONT)
        text = str(caught.value)
        assert "step 2" in text and "rank 0" in text and str(pid) in text and root in text, text
        mgr.save(3, {"s": _state(3)}).wait()
        assert mgr._saver.pid == pid and mgr.steps() == [1, 2, 3]


def test_a_restore_waits_for_a_commit_still_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's lock held by another manager's persist process: ``latest_step()`` waits for it;
    a lock nobody holds is stale and removed; past the timeout the error names the holder."""
    from shardkeeper.core.errors import CheckpointTimeoutError
    from shardkeeper.core.persist import locks

    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, {"s": _state(1)}).wait()
        url = mgr.storage.url
        fd, path = locks.hold(url, "shardkeeper/0123abcd", 0, 2)
        with pytest.raises(CheckpointTimeoutError, match=f"pid {os.getpid()} rank 0 step 2"):
            locks.wait_for_commits(url, "", 0.3, rank=0)
        assert locks.wait_for_commits(url, "shardkeeper/0123abcd", 0.3, rank=0) < 0.1  # its own: not waited for
        locks.mark(fd, 0, 2)  # as the persist process does on receipt: the process to wait for, or kill
        with pytest.raises(
            CheckpointTimeoutError, match=rf"pid {os.getpid()} \(the persist process of rank 0\) step 2"
        ):
            locks.wait_for_commits(url, "", 0.2, rank=0)
        import threading

        threading.Timer(0.5, locks.release, (fd, path)).start()
        t0 = time.monotonic()
        assert mgr.latest_step() == 1
        assert time.monotonic() - t0 >= 0.4  # it waited for the release
        stale = Path(locks.hold(url, "shardkeeper/feed", 0, 3)[1])
        os.close(os.open(stale, os.O_RDONLY))  # (the holder's descriptor is closed below: the lock is gone)
    for fd_name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd_name}") == str(stale):
                os.close(int(fd_name))
        except OSError:
            pass
    assert locks.wait_for_commits(url, "", 1.0, rank=0) < 0.5
    assert not stale.exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"writer": "disk"}, "writer"),
        ({"writer": "process", "encryption": "USER_KEYS"}, "cannot be"),
        ({"writer": "process", "local": "STORAGE"}, "pass local= as a directory path"),
    ],
    ids=["unknown", "user-key-provider", "local-storage-object"],
)
def test_what_a_persist_process_cannot_serve_is_refused_up_front(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    if kwargs.get("local") == "STORAGE":  # a local tier the persist process could not reopen
        from shardkeeper.core.storage import LocalStorage

        kwargs = {**kwargs, "local": LocalStorage(str(tmp_path / "local"))}
    if kwargs.get("encryption") == "USER_KEYS":  # a provider class of the user's own: not the core's to rebuild
        kwargs = {**kwargs, "encryption": _UserKeys(bytes(range(32)))}
    with pytest.raises(ValueError, match=match):
        CheckpointManager(str(tmp_path / "root"), **kwargs)


def test_a_script_that_ends_without_close_commits_and_leaves_no_process(tmp_path: Path) -> None:
    """The save waited for at exit, as with the thread writer; then the persist process is told
    to end, and does."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from shardkeeper.core import CheckpointManager\n"
        "mgr = CheckpointManager(sys.argv[1], writer='process')\n"
        "mgr.save(7, {'w': torch.arange(1 << 20, dtype=torch.float32)})\n"
        "print(mgr._saver.pid, flush=True)\n"
    )
    env = {**os.environ, "SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "root")], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the persist process {pid} outlived its trainer's exit")
    with CheckpointManager(str(tmp_path / "root")) as mgr:
        assert mgr.latest_step() == 7
        assert torch.equal(mgr.load(7)["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert not list((tmp_path / "locks").glob("*.lock"))


def test_a_lock_directory_others_could_plant_links_in_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock file is created and truncated by name: in a directory another user could write
    (or a link to one), a planted link would make that truncate someone else's file."""
    from shardkeeper.core.errors import CheckpointError
    from shardkeeper.core.persist import locks

    victim = tmp_path / "victim"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(shared))
    with pytest.raises(CheckpointError, match="not a directory of this user's alone"):
        locks.hold("/root", "shardkeeper/ab", 0, 1)
    link = tmp_path / "link"
    link.symlink_to(shared)
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(link))
    with pytest.raises(CheckpointError, match="SHARDKEEPER_PERSIST_LOCKS"):
        locks.wait_for_commits("/root", "", 1.0, rank=0)
    assert victim.read_text() == "precious"


def test_a_forked_child_neither_ends_the_persist_process_nor_waits_for_its_saves(tmp_path: Path) -> None:
    """A DataLoader worker or a ``multiprocessing`` fork inherits the manager: at its exit it
    must not tell the parent's persist process to close, nor wait for the parent's pending save."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    with CheckpointManager(str(tmp_path / "root"), writer="process") as mgr:
        mgr.save(1, {"s": _state(1)}).wait()
        pid = mgr._saver.pid
        child = fork.Process(target=time.sleep, args=(0,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        time.sleep(1.0)
        assert pid is not None and mgr._saver.pid == pid, "the child's exit ended its parent's persist process"
        pending = mgr.save(2, {"s": _state(2, 1 << 20)})  # the next save still has its persist process
        child = fork.Process(target=time.sleep, args=(0,))  # forked while a save is pending
        t0 = time.monotonic()
        child.start()
        child.join(60)
        assert child.exitcode == 0 and time.monotonic() - t0 < 30, "the child waited for its parent's save"
        pending.wait()
        mgr.save(3, {"s": _state(3)}).wait()
        assert mgr.steps() == [1, 2, 3]


def test_every_spelling_of_a_root_shares_its_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkeeper.core.errors import CheckpointError, CheckpointTimeoutError
    from shardkeeper.core.persist import locks

    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    fd, path = locks.hold(str(tmp_path / "link"), "shardkeeper/aa", 0, 1)
    try:
        for spelling in (str(real), f"file://{real}", str(real) + "/", str(tmp_path / "link" / ".")):
            with pytest.raises(CheckpointTimeoutError):
                locks.wait_for_commits(spelling, "", 0.1, rank=0)
    finally:
        locks.release(fd, path)
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", "relative/locks")
    with pytest.raises(CheckpointError, match="relative"):
        locks.wait_for_commits(str(real), "", 0.1, rank=0)
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "no" / "such" / "locks"))
    with pytest.raises(CheckpointError, match="cannot be made"):
        CheckpointManager(str(real), writer="process")
    assert not (tmp_path / "no").exists()


def test_a_persist_process_imports_nothing_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m`` puts the working directory before the standard library on the path: a
    ``json.py`` in a trainer's working directory (another user's to write, in a shared
    directory) would run as the trainer's user in its persist process."""
    planted = tmp_path / "cwd"
    planted.mkdir()
    ran = tmp_path / "ran"
    (planted / "json.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise ImportError('planted')\n")
    monkeypatch.chdir(planted)
    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    with CheckpointManager(str(tmp_path / "root"), writer="process") as mgr:
        mgr.save(1, {"s": _state(1)}).wait()
        assert mgr.steps() == [1]
    assert not ran.exists(), "the persist process imported json.py from the working directory"


def test_a_persist_process_that_dies_before_it_is_ready_fails_the_save_as_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save waits for its persist process to be ready; one killed meanwhile (its
    start crashed, the OOM killer) fails that save with the error a dead persist process gives,
    naming how it ended, and the next save starts a new one."""
    import threading

    monkeypatch.setenv("SHARDKEEPER_PERSIST_LOCKS", str(tmp_path / "locks"))
    with CheckpointManager(str(tmp_path / "root"), writer="process") as mgr:
        pid = mgr._saver.pid
        assert pid is not None
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()  # torch alone takes longer to import
        with pytest.raises(CheckpointSaveError) as caught:
            mgr.save(1, {"s": _state(1)}).wait()
        assert "SIGKILL" in str(caught.value) and str(pid) in str(caught.value), str(caught.value)
        mgr.save(2, {"s": _state(2)}).wait()
        assert mgr.steps() == [2]
