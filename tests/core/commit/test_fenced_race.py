"""Fenced commit on every backend: two writer processes save the same step
of one root and reach the manifest's conditional write together; exactly one commits, the
other gets a ``CommitConflictError`` naming the step, and the committed checkpoint holds only
the winner's files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.layout import step_dir

from ..dist.race_writer import STEP, state

WORKER = Path(__file__).parents[1] / "dist" / "race_writer.py"


def test_two_writers_racing_one_step_on_every_backend(every_storage_root, tmp_path: Path) -> None:
    spec = [{"name": n, "url": r.url, "options": r.options} for n, r in every_storage_root.items()]
    procs = []
    for name, seed in (("a", 1), ("b", 2)):
        cmd = [
            sys.executable,
            str(WORKER),
            name,
            str(seed),
            str(tmp_path / "barrier"),
            str(tmp_path / f"{name}.json"),
            json.dumps(spec),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, out[-4000:]
    results = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")}
    seeds = {"a": 1, "b": 2}
    for root_name, root in every_storage_root.items():
        outcomes = {w: results[w][root_name] for w in ("a", "b")}
        winners = [w for w, r in outcomes.items() if r["outcome"] == "committed"]
        assert len(winners) == 1, (root_name, outcomes)
        winner, loser = winners[0], ({"a", "b"} - set(winners)).pop()
        error = outcomes[loser]["error"]
        assert f"step {STEP} was committed" in error and "by another writer" in error, (root_name, error)
        assert "files were discarded" in error, (root_name, error)
        assert root.url.split("://")[-1] in error, (root_name, error)

        storage = root.open()
        sd = step_dir(STEP)
        manifest = json.loads(storage.read_bytes(f"{sd}/manifest.json"))
        referenced = {c["file"] for leaf in manifest["leaves"].values() for c in leaf.get("chunks", [])}
        won = {p.removeprefix(f"{sd}/") for p in outcomes[winner]["written"]}
        lost = {p.removeprefix(f"{sd}/") for p in outcomes[loser]["written"]}
        assert won and lost and not won & lost, (root_name, won, lost)  # names are unique per attempt
        assert referenced <= won, (root_name, referenced, won)
        present = {f"data/{n.rstrip('/')}" for n in storage.list_dir(f"{sd}/data")}
        assert present == won, (root_name, present, won)  # the loser cleaned up after itself

        target = {"w": torch.zeros(256, 128), "b": torch.zeros(1000), "meta": {"seed": -1}}
        with CheckpointManager(root.url, storage_options=root.options) as mgr:
            assert mgr.steps() == [STEP]
            assert mgr.restore(target) == STEP
        expected = state(seeds[winner])
        assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"]), root_name
        assert target["meta"] == {"seed": seeds[winner]}, root_name
    assert set(every_storage_root) >= {"local", "s3"}, every_storage_root  # the everyday servers ran
