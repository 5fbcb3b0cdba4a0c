"""The local backend stays inside its root, survives odd entries, and commits exclusively.

Real files, real symbolic links and FIFOs, real ``CheckpointManager`` saves and the real CLI:

- a symbolic link that leaves the root (inside a step directory, or as a step directory) is
  never read, listed or deleted through, by gc, retention or restore; the link itself may go;
- a FIFO or a link to ``/dev/zero`` where the format has a file neither hangs nor reads
  without bound: it is damage, and restore falls back;
- one entry that is not what the format says (a symlink loop, a file where a directory
  should be, a name too long, a directory named ``manifest.json``) marks its step damaged,
  not the root broken; a real I/O failure is still raised, not fallen back from;
- put-if-absent without hard links is exclusive across processes;
- a path whose ``..`` climbs above the root is refused by every operation, while ``..`` that
  stays inside (``step-2/../step-1/...``) reads as before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardkeeper.core
from shardkeeper.core import CheckpointManager, CorruptCheckpointError, StorageError
from shardkeeper.core.cli import main
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.storage.retry import RetryingStorage, RetryPolicy

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings(r"ignore:step \d+ under .* is damaged")]

RACER = Path(__file__).parents[1] / "dist" / "noreplace_racer.py"
SOURCES = str(Path(shardkeeper.core.__file__).parents[2])  # the sources under test, for subprocesses


# ---------------------------------------------------------------------------- helpers


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g), "meta": {"seed": seed}}


def _save(root: Path, *steps: int, **kw) -> None:
    with CheckpointManager(root, **kw) as mgr:
        for s in steps:
            mgr.save(s, _state(s), async_save=False)


def _restore(root: Path, step: int | None = None) -> int:
    """Restore into zeros, check bit for bit against the state saved at the restored step."""
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "meta": {"seed": -1}}
    with CheckpointManager(root) as mgr:
        got = mgr.restore(target, step=step)
    want = _state(got)
    assert torch.equal(target["w"], want["w"]) and torch.equal(target["b"], want["b"]), got
    assert target["meta"]["seed"] == got
    return got


def _steps(root: Path) -> list[int]:
    with CheckpointManager(root) as mgr:
        return mgr.steps()


def _tree(top: Path) -> dict[str, bytes | str]:
    """Every entry under ``top`` (links not followed): files by content, dirs and links marked."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath, n)
            rel = str(p.relative_to(top))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("<dir>" if p.is_dir() else p.read_bytes())
    return out


def _outside(tmp_path: Path, name: str = "outside") -> tuple[Path, dict[str, bytes | str]]:
    d = tmp_path / name
    (d / "sub").mkdir(parents=True)
    for i in range(3):
        (d / f"f{i}.bin").write_bytes(os.urandom(100 + i))
    (d / "sub" / "deep.safetensors").write_bytes(b"not yours")
    return d, _tree(d)


def _cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().out


@contextlib.contextmanager
def _fifo_guard(*fifos: Path, after_s: float = 3.0) -> Iterator[list[bool]]:
    """If the body is still running after ``after_s``, keep opening the write end of each FIFO,
    so that a reader blocked in open() gets EOF: a failing test fails instead of hanging CI.
    The list it yields gets an entry when that was needed (the code under test hung)."""
    hung: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        if done.wait(after_s):
            return
        hung.append(True)
        while not done.is_set():
            for f in fifos:
                try:
                    fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
                except OSError:
                    continue
                os.close(fd)
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield hung
    finally:
        done.set()
        t.join()


def _damage_warnings(caught: list[warnings.WarningMessage]) -> set[int]:
    out = set()
    for w in caught:
        text = str(w.message)
        if "is damaged" in text and text.startswith("step "):
            out.add(int(text.split()[1]))
    return out


# ---------------------------------------------------------------------------- 1. symbolic links


@pytest.mark.parametrize("where", ["committed", "uncommitted", "tombstone"])
def test_gc_never_deletes_through_a_link_that_leaves_the_root(tmp_path, capsys, where):
    """In a committed step (stray entries go one by one), an uncommitted one (the whole
    directory goes), and a tombstone: uncommitted, but with files a committed incremental
    step references, so the others go one by one."""
    root = tmp_path / "run"
    outside, before = _outside(tmp_path)
    _save(root, 1, 2, incremental=where == "tombstone")
    if where == "committed":
        link = root / step_dir(2) / "x"
    elif where == "tombstone":
        with CheckpointManager(root, incremental=True) as mgr:  # reuses every chunk of step 2
            mgr.save(3, {**_state(2), "meta": {"seed": 3}}, async_save=False)
        (root / step_dir(2) / "manifest.json").unlink()  # as retention does: the manifest first
        link = root / step_dir(2) / "x"
    else:
        (root / step_dir(3) / "data").mkdir(parents=True)
        (root / step_dir(3) / "data" / "r00000-deadbeef-000.safetensors").write_bytes(b"leftover")
        link = root / step_dir(3) / "x"
    os.symlink(outside, link)

    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    assert _tree(outside) == before  # contents and count
    assert not os.path.lexists(link)  # the link itself went, as a link
    if where == "tombstone":
        assert _steps(root) == [1, 3] and any((root / step_dir(2) / "data").iterdir())
        target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "meta": {"seed": -1}}
        with CheckpointManager(root) as mgr:
            assert mgr.restore(target) == 3
        assert torch.equal(target["w"], _state(2)["w"]) and torch.equal(target["b"], _state(2)["b"])
        assert _restore(root, 1) == 1
        return
    assert _steps(root) == [1, 2]
    assert _restore(root) == 2 and _restore(root, 1) == 1


def test_retention_of_incremental_saves_and_gc_leave_a_linked_scratch_dir_alone(tmp_path, capsys):
    root = tmp_path / "run"
    outside, before = _outside(tmp_path, "scratch")
    with CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        mgr.save(1, _state(1), async_save=False)
        os.symlink(outside, root / step_dir(1) / "scratch")
        # Step 2 reuses step 1's files, so retention keeps them and deletes the rest one by one.
        mgr.save(2, {**_state(1), "meta": {"seed": 2}}, async_save=False)
        assert mgr.steps() == [2]
    assert _tree(outside) == before
    assert not os.path.lexists(root / step_dir(1) / "scratch")
    assert any((root / step_dir(1) / "data").iterdir())  # referenced by step 2: kept

    os.symlink(outside, root / step_dir(1) / "again")  # the tombstone directory, now under gc
    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    assert _tree(outside) == before
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "meta": {"seed": -1}}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(target) == 2
    assert torch.equal(target["w"], _state(1)["w"]) and target["meta"]["seed"] == 2


def test_a_step_directory_linked_to_another_run_is_not_committed(tmp_path, capsys):
    other = tmp_path / "other-run"
    _save(other, 5, 9)
    other_before = _tree(other)
    root = tmp_path / "run"
    _save(root, 1)
    for s in (5, 9):
        os.symlink(other / step_dir(s), root / step_dir(s))

    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
        assert mgr.latest_step() == 1
        assert not mgr.is_committed(5) and not mgr.is_committed(9)
        with pytest.raises(CorruptCheckpointError) as e:
            mgr.restore(_state(0), step=9)
    assert step_dir(9) in str(e.value) and "leaves the root" in str(e.value), e.value
    assert _restore(root) == 1  # never the other run's newer step

    with CheckpointManager(root, keep_last=1) as mgr:  # retention over the linked steps
        mgr.save(6, _state(6), async_save=False)
        assert mgr.steps() == [6]
    assert _tree(other) == other_before

    rc, out = _cli("ls", str(root), "--json", capsys=capsys)
    assert rc == 0, out
    rows = {r["step"]: r["status"] for r in json.loads(out)["steps"]}
    assert rows == {5: "uncommitted", 6: "committed", 9: "uncommitted"}, rows
    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    assert not os.path.lexists(root / step_dir(5)) and not os.path.lexists(root / step_dir(9))
    assert _tree(other) == other_before  # gc removed the links, never their targets
    assert _restore(root) == 6
    assert _restore(other) == 9 and _restore(other, 5) == 5


def test_the_root_itself_may_be_a_link(tmp_path, capsys):
    real = tmp_path / "real-run"
    real.mkdir()
    root = tmp_path / "run-link"
    os.symlink(real, root)
    _save(root, 1, 2, 3, keep_last=2)
    assert _steps(root) == [2, 3]
    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    rc, out = _cli("verify", str(root), capsys=capsys)
    assert rc == 0, out
    assert _restore(root) == 3 and _restore(root, 2) == 2
    assert sorted(os.listdir(real)) == ["LATEST", step_dir(2), step_dir(3)]


def test_links_that_stay_inside_the_root_are_followed_for_reads(tmp_path, capsys):
    root = tmp_path / "run"
    _save(root, 1)
    data = root / step_dir(1) / "data"
    (name,) = os.listdir(data)
    (root / "pool").mkdir()
    shutil.move(data / name, root / "pool" / name)
    os.symlink(f"../../pool/{name}", data / name)  # relative, stays inside
    (root / "abs").mkdir()
    os.symlink(root / step_dir(1) / "manifest.json", root / "abs" / "m.json")  # absolute, inside
    assert LocalStorage(root).read_bytes("abs/m.json") == (root / step_dir(1) / "manifest.json").read_bytes()

    assert _restore(root) == 1
    rc, out = _cli("verify", str(root), capsys=capsys)
    assert rc == 0, out
    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    assert (data / name).is_symlink() and (root / "pool" / name).is_file()  # referenced: kept
    assert _restore(root) == 1


# ---------------------------------------------------------------------------- 2. special files


def test_fifos_where_the_format_has_files_neither_hang_nor_break_the_root(tmp_path, capsys):
    root = tmp_path / "run"
    _save(root, 1, 2, 3)
    fifo_manifest = root / step_dir(4) / "manifest.json"
    fifo_manifest.parent.mkdir()
    os.mkfifo(fifo_manifest)
    data = root / step_dir(3) / "data"
    (name,) = os.listdir(data)
    os.unlink(data / name)
    os.mkfifo(data / name)  # a committed step whose shard file is a FIFO

    with _fifo_guard(fifo_manifest, data / name) as hung:
        with CheckpointManager(root) as mgr:
            assert mgr.steps() == [1, 2, 3]
            assert mgr.latest_step() == 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _restore(root) == 2
        rc, out = _cli("ls", str(root), "--json", capsys=capsys)
        try:
            LocalStorage(root).read_bytes(f"{step_dir(4)}/manifest.json")
            error: Exception | None = None
        except Exception as e:  # noqa: BLE001 - checked below, once the guard is done
            error = e
    assert not hung, "a read waited on a FIFO"
    assert _damage_warnings(caught) == {3, 4}, [str(w.message) for w in caught]
    assert isinstance(error, CorruptCheckpointError), error
    assert "FIFO" in str(error) and step_dir(4) in str(error)
    assert rc == 0, out
    assert {r["step"]: r["status"] for r in json.loads(out)["steps"]}[4] == "invalid"


_READ_IN_A_SUBPROCESS = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from shardkeeper.core.errors import CorruptCheckpointError
from shardkeeper.core.storage import LocalStorage
storage, out = LocalStorage(sys.argv[1]), {}
for path in sys.argv[2:]:
    try:
        storage.read_bytes(path)
        out[path] = "read"
    except CorruptCheckpointError as e:
        out[path] = "damage: " + str(e)
    except BaseException as e:
        out[path] = type(e).__name__ + ": " + str(e)[:200]
print(json.dumps(out))
"""


def test_a_link_to_dev_zero_is_refused_before_reading(tmp_path, capsys):
    root = tmp_path / "run"
    _save(root, 1, 2)
    (root / step_dir(3)).mkdir()
    os.symlink("/dev/zero", root / step_dir(3) / "manifest.json")
    data = root / step_dir(2) / "data"
    (name,) = os.listdir(data)
    os.unlink(data / name)
    os.symlink("/dev/zero", data / name)
    paths = [f"{step_dir(3)}/manifest.json", f"{step_dir(2)}/data/{name}"]
    # In a child first, with its memory bounded: a read without bound fails there, not here.
    proc = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_SUBPROCESS, str(root), *paths],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SOURCES},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    for p in paths:
        assert got[p].startswith("damage: ") and "leaves the root" in got[p], got

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _restore(root) == 1
    assert _damage_warnings(caught) == {2, 3}, [str(w.message) for w in caught]
    rc, out = _cli("ls", str(root), "--json", capsys=capsys)
    assert rc == 0, out
    # step 2 (a data file that is a link out of the root) was quarantined by the fallback restore;
    # step 3's manifest, a link out of the root, cannot be copied aside: it stays, invalid
    statuses = {r["step"]: r["status"] for r in json.loads(out)["steps"]}
    assert statuses == {1: "committed", 2: "quarantined", 3: "invalid"}, statuses


# ---------------------------------------------------------------------------- 3. one bad entry


def _damaged_root(tmp_path: Path) -> Path:
    """Good steps 1, 2; then 3: manifest.json a symlink loop; 4: the step directory a symlink
    loop; 5: committed, ``data`` a file (ENOTDIR); 6: committed, its manifest names a file
    whose name is too long; 7: ``manifest.json`` a directory (EISDIR)."""
    root = tmp_path / "run"
    _save(root, 1, 2, 5, 6)
    (root / step_dir(3)).mkdir()
    os.symlink("manifest.json", root / step_dir(3) / "manifest.json")
    os.symlink(step_dir(4), root / step_dir(4))
    shutil.rmtree(root / step_dir(5) / "data")
    (root / step_dir(5) / "data").write_bytes(b"not a directory")
    manifest = root / step_dir(6) / "manifest.json"
    (name,) = os.listdir(root / step_dir(6) / "data")
    manifest.write_text(manifest.read_text().replace(name, "r" + "0" * 300 + ".safetensors"))
    (root / step_dir(7) / "manifest.json").mkdir(parents=True)
    return root


def test_one_bad_entry_marks_one_step_damaged_not_the_root_broken(tmp_path, capsys):
    root = _damaged_root(tmp_path)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1, 2, 5, 6]  # 5 and 6 have valid manifests: their data is damaged
        assert mgr.latest_step() == 6
        for s in (3, 4, 5, 6, 7):
            with pytest.raises(CorruptCheckpointError) as e:
                mgr.restore(_state(0), step=s)
            assert step_dir(s) in str(e.value), e.value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _restore(root) == 2
    assert _damage_warnings(caught) == {3, 5, 6, 7}, [str(w.message) for w in caught]

    rc, out = _cli("ls", str(root), "--json", capsys=capsys)
    assert rc == 0, out
    assert {r["step"]: r["status"] for r in json.loads(out)["steps"]} == {
        1: "committed",
        2: "committed",
        3: "invalid",
        4: "uncommitted",
        5: "committed",
        6: "committed",
        7: "invalid",
    }
    rc, out = _cli("verify", str(root), "--json", capsys=capsys)
    assert rc == 1, out  # damage found, reported step by step (not an error that stops it)
    problems = {p["step"] for p in json.loads(out)["problems"]} | {
        s["step"] for s in json.loads(out)["steps"] if not s["ok"]
    }
    assert problems == {3, 5, 6, 7}, out
    rc, out = _cli("gc", str(root), "--min-age-s", "0", capsys=capsys)
    assert rc == 0, out
    assert sorted(os.listdir(root)) == ["LATEST", step_dir(1), step_dir(2), step_dir(5), step_dir(6)]
    assert _restore(root) == 2 and _restore(root, 1) == 1


def test_damage_is_not_retried_and_an_io_error_is_not_fallen_back_from(tmp_path, monkeypatch):
    root = _damaged_root(tmp_path)
    storage = RetryingStorage(LocalStorage(root), RetryPolicy(max_attempts=4, base_delay_s=2.0))
    t0 = time.monotonic()
    for path in (
        f"{step_dir(3)}/manifest.json",
        f"{step_dir(4)}/manifest.json",
        f"{step_dir(7)}/manifest.json",
        f"{step_dir(5)}/data/x.safetensors",
    ):
        with pytest.raises(CorruptCheckpointError):
            storage.read_bytes(path)
    assert storage.retries == 0 and time.monotonic() - t0 < 1.0

    shutil.rmtree(root / step_dir(5))
    shutil.rmtree(root / step_dir(6))

    def eio(fd, buffers, offset, *args):  # a failing disk: nothing real here produces one
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "meta": {"seed": -1}}
    with CheckpointManager(root, retry_base_delay_s=0.0) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(StorageError) as e:
                mgr.restore(target)
        assert mgr.storage.retries == 0
    assert not isinstance(e.value, CorruptCheckpointError)
    assert "step 2" in str(e.value) and "retry" in str(e.value), e.value
    assert _damage_warnings(caught) == {3, 7}  # damage fell back; the I/O failure on 2 did not
    monkeypatch.undo()
    assert _restore(root) == 2


# ---------------------------------------------------------------------------- 4. put-if-absent


def _renameat2_works(d: Path) -> bool:
    try:
        from shardkeeper.core.storage.noreplace import rename_noreplace
    except ImportError:  # sources without it: the race below shows what they do instead
        return True
    (d / "a").write_bytes(b"a")
    try:
        rename_noreplace(str(d / "a"), str(d / "b"))
    except OSError:
        return False
    return (d / "b").read_bytes() == b"a"


@pytest.mark.parametrize("mode", ["renameat2", "excl"])
def test_put_if_absent_without_hard_links_is_exclusive_across_processes(tmp_path, mode):
    """Two processes put the same 1000 names, each round started at the same instant.

    No file system without hard links is available here, so the workers replace ``os.link``
    with one that fails with EPERM (what such file systems answer); in mode ``excl`` they
    also make ``renameat2(RENAME_NOREPLACE)`` answer EINVAL, leaving the exclusive create.
    """
    if mode == "renameat2" and not _renameat2_works(tmp_path):
        pytest.skip("this file system refuses renameat2(RENAME_NOREPLACE)")
    root = tmp_path / "root"
    root.mkdir()
    rounds, start = 1000, time.time() + 1.5
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RACER),
                name,
                mode,
                str(root),
                str(start),
                str(rounds),
                "0.003",
                str(tmp_path / f"{name}.json"),
            ],
            env={**os.environ, "PYTHONPATH": SOURCES},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out[-3000:]
    reports = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
    a, b = (r["results"] for r in reports)
    sys.path.insert(0, str(RACER.parent))
    try:
        from noreplace_racer import payload
    finally:
        sys.path.remove(str(RACER.parent))
    both = [i for i in range(rounds) if a[i] == b[i] == "won"]
    assert not both, f"both writers won {len(both)} of {rounds} rounds, e.g. {both[:5]}"
    for i in range(rounds):
        assert sorted([a[i], b[i]]) == ["conflict", "won"], (i, a[i], b[i])
        winner = "a" if a[i] == "won" else "b"
        assert (root / f"r{i:04d}" / "manifest.json").read_bytes() == payload(winner, i), i
        assert os.listdir(root / f"r{i:04d}") == ["manifest.json"], i  # no temporary file left
    assert all(r["calls"]["rename_noreplace"] == rounds for r in reports), reports[0]["calls"]  # the fallback ran


def test_no_operation_climbs_above_the_root_with_dotdot(tmp_path):
    """A path from a report or a manifest with ``..`` past the root's top is damage for every
    operation: nothing outside is read, sized, listed, written or deleted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"secret")
    root = tmp_path / "root"
    storage = LocalStorage(root)
    storage.put("step-1/a", b"abc")
    (root / "step-2").mkdir()
    climbing = ["../outside/victim", "step-1/../../outside/victim", "step-1/x/../../../outside/victim"]
    operations = {
        "size": lambda p: storage.size(p),
        "sizes": lambda p: storage.sizes(["step-1/a", p]),
        "mtime": lambda p: storage.mtime(p),
        "read_bytes": lambda p: storage.read_bytes(p),
        "read_range": lambda p: storage.read_range(p, 0, 2),
        "list_dir": lambda p: storage.list_dir(p.rsplit("/", 1)[0]),
        "put": lambda p: storage.put(p + "-new", b"x"),
        "put_if_absent": lambda p: storage.put_if_absent(p + "-pia", b"x"),
        "open_writer": lambda p: storage.open_writer(p + "-w"),
        "delete": lambda p: storage.delete(p),
        "sync_dir": lambda p: storage.sync_dir(p.rsplit("/", 1)[0]),
    }
    for path in climbing:
        assert storage.exists(path) is False
        for op in operations.values():
            with pytest.raises(CorruptCheckpointError, match=r"climbs above the checkpoint root"):
                op(path)
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == b"secret"
    # ``..`` that stays inside the root resolves as the kernel resolves it
    assert storage.size("step-2/../step-1/a") == 3 and storage.read_bytes("step-2/../step-1/a") == b"abc"
    assert storage.sizes(["step-2/../step-1/a", "step-1/a"]) == [3, 3]
