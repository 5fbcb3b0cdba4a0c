"""What a save protects, tested with real concurrent processes: a saver paused inside its
commit (right before the manifest's put, or before the commit's first record) while another
process deletes the base step of its incremental save, or runs gc with no minimum age.

Every outcome must be one of two: the save commits and restores bit for bit, or it fails
with an error that says what happened and nothing is committed. Never a committed step over
missing bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.lifecycle.gc import collect_garbage
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.wrapper import StorageWrapper
from shardkeeper.core.verify.step import verify_step

SCRIPT = Path(__file__).parents[1] / "dist" / "commit_race.py"
REPO = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def _race(tmp_path: Path, point: str, kind: str, deleter: list[str]) -> tuple[dict, dict, Path]:
    root, ctl = tmp_path / "root", tmp_path / "ctl"
    ctl.mkdir()
    subprocess.run([sys.executable, str(SCRIPT), "setup", str(root)], check=True, env=_env(), timeout=120)
    saver = subprocess.Popen([sys.executable, str(SCRIPT), "save", str(root), str(ctl), point, kind], env=_env())
    other = subprocess.Popen([sys.executable, str(SCRIPT), deleter[0], str(root), str(ctl), *deleter[1:]], env=_env())
    try:
        assert saver.wait(timeout=120) == 0 and other.wait(timeout=120) == 0
    finally:
        for p in (saver, other):
            if p.poll() is None:
                p.kill()
    return json.loads((ctl / "saved.json").read_text()), json.loads((ctl / "deleter.json").read_text()), root


def _restores_step_3(root: Path) -> None:
    assert verify_step(open_storage(str(root)), 3).ok
    got = {"w": torch.zeros(64, 256), "step": 0}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got, step=3) == 3
    g = torch.Generator().manual_seed(1)
    assert torch.equal(got["w"], torch.randn(64, 256, generator=g)) and got["step"] == 3


def test_deleting_the_base_right_before_the_put_keeps_what_the_commit_references(tmp_path: Path) -> None:
    saved, deleter, root = _race(tmp_path, "put", "incremental", ["delete", "1"])
    assert deleter["deleted"] is True
    assert saved["committed"], saved
    assert not (root / step_dir(1) / "manifest.json").exists()  # step 1 is gone as a step ...
    _restores_step_3(root)  # ... but the files step 3 references were kept
    assert not [n for n in os.listdir(root) if n.startswith("pending.")]


def test_deleting_the_base_before_the_commit_fails_that_save_cleanly(tmp_path: Path) -> None:
    saved, deleter, root = _race(tmp_path, "intent", "incremental", ["delete", "1"])
    assert deleter["deleted"] is True
    assert not saved["committed"]
    assert "step 1 was deleted while this save ran" in saved["error"] and "nothing was committed" in saved["error"]
    assert not (root / step_dir(3) / "manifest.json").exists()
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [5]


def test_gc_right_before_the_put_leaves_the_commit_alone(tmp_path: Path) -> None:
    saved, report, root = _race(tmp_path, "put", "full", ["gc"])
    assert saved["committed"], saved
    _restores_step_3(root)
    assert step_dir(3) in report["kept_in_flight"], report
    assert not [n for n in os.listdir(root) if n.startswith("pending.")]  # the intent and the claim are gone


def test_gc_before_the_commit_makes_that_save_fail_cleanly(tmp_path: Path) -> None:
    saved, report, root = _race(tmp_path, "intent", "full", ["gc"])
    assert step_dir(3) + "/" in report["removed_dirs"], report
    assert not saved["committed"]
    assert "step 3" in saved["error"] and ("missing" in saved["error"] or "gc" in saved["error"]), saved
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]


class _Before(StorageWrapper):
    """Runs ``hook`` once, right before the first ``op`` on a path that ``match`` accepts."""

    def __init__(self, inner: object, op: str, match, hook) -> None:  # type: ignore[no-untyped-def]
        super().__init__(inner)  # type: ignore[arg-type]
        self._op, self._match, self._hook = op, match, hook

    def _maybe(self, op: str, path: str) -> None:
        if op == self._op and self._hook is not None and self._match(path):
            hook, self._hook = self._hook, None
            hook()

    def put(self, path: str, data: bytes) -> None:
        self._maybe("put", path)
        self.inner.put(path, data)

    def delete(self, path: str) -> None:
        self._maybe("delete", path)
        self.inner.delete(path)


def test_a_commit_between_gcs_listing_and_its_claim_is_not_collected(tmp_path: Path) -> None:
    """gc judged the step directory a leftover; the save then committed (and removed its
    intent) before gc wrote its claim: gc must see the new manifest, not delete the step."""
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    handle = mgr.save(1, {"w": torch.ones(1 << 20)})
    while not (root / step_dir(1) / "data").is_dir():
        time.sleep(0.001)
    gc_storage = _Before(open_storage(str(root)), "put", lambda p: p.startswith("pending.claim."), handle.wait)
    report = collect_garbage(gc_storage, min_age_s=0.0)
    assert step_dir(1) in report.kept_in_flight or not report.removed_paths, report
    assert mgr.steps() == [1]
    got = {"w": torch.zeros(1 << 20)}
    assert mgr.restore(got) == 1 and torch.equal(got["w"], torch.ones(1 << 20))
    mgr.close()


class _Held(StorageWrapper):
    """Holds the commit's first record (its intent, ``pending.*``) until ``release`` is set."""

    def __init__(self, inner: object, release: threading.Event) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self._release = release

    def put(self, path: str, data: bytes) -> None:
        if path.startswith("pending."):
            assert self._release.wait(60), "the commit was never released"
        self.inner.put(path, data)


def test_a_commit_between_retentions_listing_and_its_deletes_keeps_its_references(tmp_path: Path) -> None:
    """delete() of the base of an incremental save listed the remaining steps' references;
    the save then committed (and removed its intent) before the base's manifest was deleted:
    the files the new step references must stay."""
    root = tmp_path / "root"
    frozen = torch.arange(1 << 18, dtype=torch.float32)

    def state(v: float) -> dict:
        return {"frozen": frozen, "live": torch.full((1 << 18,), v)}

    with CheckpointManager(root, async_save=False) as w:
        w.save(1, state(1.0))
    release = threading.Event()
    saver = CheckpointManager(_Held(open_storage(str(root)), release), incremental=True)
    handle = saver.save(5, state(5.0))  # its base is step 1; held before its commit's first record
    with CheckpointManager(root, async_save=False) as w:
        w.save(10, state(10.0))  # another writer on the root: step 1 is no longer the newest

    def commit_now() -> None:
        release.set()
        handle.wait()

    deleter_storage = _Before(
        open_storage(str(root)), "delete", lambda p: p == f"{step_dir(1)}/manifest.json", commit_now
    )
    with CheckpointManager(deleter_storage) as deleter:
        assert deleter.delete(1)
    got = {"frozen": torch.zeros_like(frozen), "live": torch.zeros(1 << 18)}
    assert saver.restore(got, step=5) == 5
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["live"], torch.full((1 << 18,), 5.0))
    saver.close()


def test_saves_racing_a_gc_loop_lose_nothing(tmp_path: Path) -> None:
    """One thread saves and waits, another runs gc with no minimum age in a loop: every
    acknowledged save stays committed and restores."""
    root = tmp_path / "root"
    done = threading.Event()
    errors: list[BaseException] = []

    def gc_loop() -> None:
        storage = open_storage(str(root))
        while not done.is_set():
            try:
                collect_garbage(storage, min_age_s=0.0)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    acked = []
    t = threading.Thread(target=gc_loop)
    t.start()
    try:
        with CheckpointManager(root, storage_options={"fsync": False}) as mgr:
            for step in range(1, 41):
                try:
                    mgr.save(step, {"w": torch.full((1 << 14,), float(step))}).wait()
                except CheckpointError:
                    continue  # gc judged it abandoned before its commit: failed, never acknowledged
                acked.append(step)
    finally:
        done.set()
        t.join(60)
    assert not errors, errors
    assert acked, "no save survived the gc loop"
    with CheckpointManager(root) as mgr:
        assert set(acked) <= set(mgr.steps()), f"acknowledged but gone: {sorted(set(acked) - set(mgr.steps()))}"
        for step in acked[-3:]:
            got = {"w": torch.zeros(1 << 14)}
            assert mgr.restore(got, step=step) == step and torch.equal(got["w"], torch.full((1 << 14,), float(step)))


def _leftover(root: Path) -> None:
    """An uncommitted step 3 (a killed save's files) beside a committed step 1."""
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    (root / step_dir(3) / "data").mkdir(parents=True)
    (root / step_dir(3) / "data" / "r00000-00000000-000.safetensors").write_bytes(b"x" * 64)


def test_a_record_cannot_pin_a_step_longer_than_a_commit_may_take(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _leftover(root)
    (root / f"pending.intent.{step_dir(3)}.deadbeef.json").write_text(
        json.dumps(
            {
                "kind": "intent",
                "steps": [3],
                "ttl_s": 1e308,
                "files": [f"{step_dir(3)}/data/r00000-00000000-000.safetensors"],
            }
        )
    )
    storage = open_storage(str(root))
    assert step_dir(3) in collect_garbage(storage, min_age_s=0.0).kept_in_flight  # live while young
    later = collect_garbage(storage, min_age_s=0.0, now=time.time() + 3600)  # its claim of 1e308 s is ignored
    assert step_dir(3) + "/" in later.removed_dirs, later
    assert not [n for n in os.listdir(root) if n.startswith("pending.")]


def test_an_unreadable_record_stops_gc_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _leftover(root)
    bad = root / f"pending.intent.{step_dir(3)}.deadbeef.json"
    bad.mkdir()  # not a file: what it protects is unknown
    report = collect_garbage(open_storage(str(root)), min_age_s=0.0)
    assert not report.removed_paths and bad.name in " ".join(report.errors), report
    assert "remove it" in " ".join(report.errors)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
