"""A persist process killed during a save, with a node-local tier and ``writer="process"``:
2 gloo ranks under torchrun, each its own local directory (two simulated nodes),
``replicas=1``.

    tier_persist_kill_worker.py OUT MODE [KILLED]

MODE ``kill``: step 1 is saved; rank KILLED's persist process (default 1; rank 0's is the one
whose store the persist processes meet on) is stopped and SIGKILLed right after ``save(2)``
returned: step 2 fails on both ranks (well within the commit timeout), and step 3
commits on both, recorded on both nodes. Each persist process's pid goes to ``pids<rank>``.
MODE ``resume``: a fresh launch (thread writer) finds step 3 on both nodes, loses node 1's
directory and restores step 3 bit for bit from the local tier (node 1's files from their
replicas on node 0).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, CheckpointSaveError, PerRank
from tests.checks import Checks

checks = Checks()
check = checks.check


def state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"shared": torch.arange(4096, dtype=torch.float32) * step, "own": PerRank(torch.randn(1 << 20, generator=g))}


def manifests(node: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in node.glob("step-*") if (p / "manifest.json").exists())


def kill(out: Path, rank: int, kw: dict[str, Any], killed: int) -> None:
    pids: list[int] = []
    with CheckpointManager(out / "root", writer="process", **kw) as mgr:
        mgr.save(1, state(1, rank)).wait()
        pids.append(mgr._saver.pid)  # type: ignore[attr-defined]
        dist.barrier()
        t0 = time.monotonic()
        h = mgr.save(2, state(2, rank))
        if rank == killed:  # stopped before it can write, then killed: it never reports
            os.kill(pids[0], signal.SIGSTOP)
            os.kill(pids[0], signal.SIGKILL)
        try:
            h.wait()
        except CheckpointSaveError as e:
            text = str(e)
            check("save 2 fails naming its step and a rank", "step 2" in text and "rank" in text, text)
            if rank == killed:
                check(f"rank {rank}'s failure names the signal", f"rank {rank}" in text and "SIGKILL" in text, text)
        else:
            check("save 2 fails", False, f"committed although rank {killed}'s persist process was killed")
        waited = time.monotonic() - t0
        check("save 2's failure heard well within the commit timeout", waited < 30, f"{waited:.1f} s")
        dist.barrier()
        t0 = time.monotonic()
        try:
            mgr.save(3, state(3, rank)).wait()
        except CheckpointSaveError as e:
            check("save 3 commits", False, str(e))
        else:
            check("save 3 commits", True)
        waited = time.monotonic() - t0
        check("save 3 took no timeout", waited < 30, f"{waited:.1f} s")
        pids.append(mgr._saver.pid or 0)  # type: ignore[attr-defined]
        dist.barrier()  # every node recorded step 3 before any rank looks
        check("step 3 recorded on this node", 3 in manifests(out / f"node{rank}"), manifests(out / f"node{rank}"))
    (out / f"pids{rank}").write_text(" ".join(map(str, pids)))


def resume(out: Path, rank: int, kw: dict[str, Any]) -> None:
    nodes = [manifests(out / f"node{r}") for r in range(2)]
    check("step 3 on both nodes", all(3 in n for n in nodes), nodes)
    dist.barrier()
    if rank == 1:  # node 1 lost: its files restore from their replicas on node 0
        shutil.rmtree(out / "node1")
        (out / "node1").mkdir()
    dist.barrier()
    with CheckpointManager(out / "root", **kw) as mgr:
        got: dict[str, Any] = {"shared": torch.zeros(4096), "own": PerRank(torch.zeros(1 << 20))}
        step = mgr.restore(got)
        check("step 3 restored", step == 3, step)
        check("from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
        check("no byte read from the persistent root", mgr.persistent_reads == 0, mgr.persistent_reads)
        want = state(3, rank)
        check(
            "bit-exact", torch.equal(got["shared"], want["shared"]) and torch.equal(got["own"].value, want["own"].value)
        )


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    killed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw: dict[str, Any] = {"local": out / f"node{rank}", "replicas": 1, "persist_every": 100, "commit_timeout_s": 600}
    checks.run(mode, lambda: kill(out, rank, kw, killed) if mode == "kill" else resume(out, rank, kw))
    checks.write(out / f"{mode}-r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
