"""One epoch over four launches of 2, 3, 1 and 4 gloo ranks, each killed (SIGKILL) and resumed
by a fresh launch, one of them with a save in flight: every sample of the epoch is consumed
exactly once, and the next epoch is the one an uninterrupted run at the last size yields.

A sample counts as consumed when a training step used it and that step committed: the steps a
hop trained after its last committed step are trained again by the next hop, which resumes
from that step (``dist/sampler_hop_worker.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shardkeeper.core import CheckpointManager
from shardkeeper.core.testing.procs import kill_tree
from tests.launch import WORKER_MAIN

from .._launch import DIST_DIR

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

N = 64  # the worker's dataset; batches of 2 a rank
#: (world size, last committed step, mode) per hop: 8, 12, 8 and 36 samples committed.
HOPS = ((2, 2, "kill"), (3, 4, "inflight"), (1, 8, "kill"), (4, 0, "finish"))


def _launch(world: int, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(WORKER_MAIN), str(DIST_DIR / "sampler_hop_worker.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _hop(out: Path, root: Path, hop: int, world: int, stop: int, mode: str) -> None:
    """One launch: to its end (``finish``), or killed once every rank is ready."""
    proc = _launch(world, str(root), str(out), str(hop), str(stop), mode)
    try:
        if mode == "finish":
            text, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, text[-6000:]
            return
        deadline = time.monotonic() + 180
        while not all((out / f"hop{hop}-ready-r{r}").exists() for r in range(world)):
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_tree(proc, dump_stacks=proc.poll() is None)
                raise AssertionError(f"hop {hop} never got ready:\n{proc.communicate(timeout=30)[0][-6000:]}")
            time.sleep(0.05)
        kill_tree(proc)  # SIGKILL to the launcher and every rank
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate(timeout=30)


def _steps(out: Path, hop: int, world: int) -> dict[int, list[int]]:
    """The sample ids each step of a hop trained on, all its ranks together."""
    by_step: dict[int, list[int]] = {}
    for r in range(world):
        for line in (out / f"hop{hop}-r{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], []).extend(rec["ids"])
    return by_step


def _position_bytes(root: Path, step: int) -> tuple[int, list[str]]:
    """The size of the sampler's entries in the step's manifest (as stored), and their keys."""
    doc: dict[str, Any] = json.loads((root / f"step-{step:012d}" / "manifest.json").read_bytes())
    entries = {k: v for k, v in doc["leaves"].items() if k.startswith("sampler/")}
    return len(json.dumps(entries, separators=(",", ":"))), sorted(entries)


def test_an_epoch_over_2_3_1_4_ranks_killed_at_each_hop_consumes_every_sample_once(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    for hop, (world, stop, mode) in enumerate(HOPS):
        _hop(out, root, hop, world, stop, mode)
        with CheckpointManager(root, process_group="local") as mgr:
            steps = mgr.steps()
        if mode == "inflight":  # the held-back save never committed, though its files were written
            assert steps[-1] == stop and (root / f"step-{stop + 1:012d}").is_dir(), steps
    restored = [int((out / f"hop{h}-restored").read_text()) for h in range(len(HOPS))]
    assert restored == [0, 2, 4, 8], restored  # each hop resumed the last committed step
    consumed: list[int] = []
    for hop, (world, _, mode) in enumerate(HOPS):
        by_step = _steps(out, hop, world)
        upto = restored[hop + 1] if hop + 1 < len(HOPS) else max(by_step)
        assert mode == "finish" or max(by_step) > upto, "a killed hop trained a step it never committed"
        consumed += [i for s, ids in by_step.items() if s <= upto for i in ids]
    assert Counter(consumed) == Counter(range(N)), sorted(Counter(consumed) - Counter(range(N)))
    ends = [json.loads((out / f"r{r}.json").read_text()) for r in range(4)]
    assert all(e["consumed"] == N and e["next_epoch_ok"] for e in ends), ends
    with CheckpointManager(root, process_group="local") as mgr:
        committed = mgr.steps()
    sizes = {s: _position_bytes(root, s) for s in committed}
    keys = {tuple(k) for _, k in sizes.values()}
    assert len(keys) == 1 and all(size <= 1024 for size, _ in sizes.values()), sizes  # one layout at 2, 3, 1, 4
