"""Processes that race a commit: a saver paused at a chosen point of its commit, and a deleter
(``delete()`` of another manager, or gc) that runs in that window.

    commit_race.py setup ROOT                     # step 1 committed (a full save)
    commit_race.py save ROOT CTL POINT KIND       # save step 3 (KIND: incremental | full), pausing
                                                  # at POINT: put (right before the manifest's put,
                                                  # after every check) | intent (before the commit's
                                                  # first write) | none
    commit_race.py delete ROOT CTL STEP           # once the saver is paused: commit step 5 (another
                                                  # writer on the root, so STEP need not be the
                                                  # newest), delete(STEP), then go
    commit_race.py gc ROOT CTL                    # once the saver is paused: gc --min-age-s 0, then go

The saver writes CTL/saved.json: {"committed": bool, "error": str}; the deleter CTL/deleter.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.lifecycle.retention import collect_garbage
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.wrapper import StorageWrapper

WAIT_S = 60.0


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(1)  # the same weights at every step: incremental reuses all
    return {"w": torch.randn(64, 256, generator=g), "step": step}


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


class Pausing(StorageWrapper):
    """Pauses the first time the commit reaches ``point``: writes CTL/paused, waits for CTL/go."""

    def __init__(self, inner: object, ctl: Path, point: str) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.ctl, self.point, self.done = ctl, point, False

    def _pause(self) -> None:
        if not self.done:
            self.done = True
            (self.ctl / "paused").write_text("1")
            wait_for(self.ctl / "go")

    def put(self, path: str, data: bytes) -> None:
        if self.point == "intent" and path.startswith("pending."):
            self._pause()
        self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> None:
        if self.point == "put" and path.endswith("manifest.json"):
            self._pause()
        self.inner.put_if_absent(path, data)


def setup(root: str) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, state(1))


def save(root: str, ctl: Path, point: str, kind: str) -> None:
    storage = Pausing(open_storage(root), ctl, point)
    out = {"committed": False, "error": ""}
    with CheckpointManager(storage, incremental=kind == "incremental") as mgr:
        handle = mgr.save(3, state(3))
        try:
            handle.wait()
            out["committed"] = True
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            out["error"] = f"{type(e).__name__}: {e}"
    (ctl / "saved.json").write_text(json.dumps(out))


def delete(root: str, ctl: Path, step: int) -> None:
    wait_for(ctl / "paused")
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, state(5))  # a save's base is the newest step below it: only a newer commit frees it
        gone = mgr.delete(step)
    (ctl / "deleter.json").write_text(json.dumps({"deleted": gone}))
    (ctl / "go").write_text("1")


def gc(root: str, ctl: Path) -> None:
    wait_for(ctl / "paused")
    report = collect_garbage(open_storage(root), min_age_s=0.0)
    (ctl / "deleter.json").write_text(json.dumps(report.to_json()))
    (ctl / "go").write_text("1")


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "setup":
        setup(root)
    elif mode == "save":
        save(root, Path(sys.argv[3]), sys.argv[4], sys.argv[5])
    elif mode == "delete":
        delete(root, Path(sys.argv[3]), int(sys.argv[4]))
    elif mode == "gc":
        gc(root, Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")
