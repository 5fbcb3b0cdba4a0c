"""The node-local tier in either writer mode, on 3 gloo ranks, each its own local directory
(three simulated nodes); the persistent root a local directory.

    tier_writer_worker.py OUT WRITER

- replicas=1, persist_every=2, local_keep=2, keep_last=1: steps 1..4 saved; 1 and 3 uploaded
  (``wait_persisted``, ``persisted_steps``), each node keeps 3 and 4, the persistent root 3.
  Node 1's directory is then deleted: step 4 restores bit for bit from the local tier (node 1's
  files from its replica), with no byte read from the persistent root.
- erasure=(2, 1): steps 1 and 2 saved; node 2 replaced by an empty directory: step 2 is
  rebuilt from parity and restores bit for bit from the local tier.

``WRITER`` writes the saves; the restores run with the thread writer (what persist processes
left is a local tier like any other; a restore's own code is the trainer's in both modes).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from tests.checks import Checks

checks = Checks()
check = checks.check


def own(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(40_000 + 777 * rank, generator=g, dtype=torch.float64)


def state(step: int, rank: int) -> dict[str, Any]:
    return {"shared": torch.arange(3000, dtype=torch.float32) * step, "own": PerRank(own(step, rank))}


def target(rank: int) -> dict[str, Any]:
    return {"shared": torch.zeros(3000), "own": PerRank(torch.zeros(40_000 + 777 * rank, dtype=torch.float64))}


def steps(d: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*") if (p / "manifest.json").exists())


def lose(node: Path, lost: bool) -> None:
    dist.barrier()
    if lost:
        shutil.rmtree(node)
        node.mkdir()
    dist.barrier()


def restored(name: str, mgr: CheckpointManager, step: int, rank: int) -> None:
    got = target(rank)
    check(f"{name}: the newest step restored", mgr.restore(got) == step, step)
    check(f"{name}: from the local tier", mgr.last_restore_tier == "local", mgr.last_restore_tier)
    check(f"{name}: no byte read from the persistent root", mgr.persistent_reads == 0, mgr.persistent_reads)
    want = state(step, rank)
    check(
        f"{name}: bit-exact",
        torch.equal(got["shared"], want["shared"]) and torch.equal(got["own"].value, want["own"].value),
    )


def replicas(out: Path, writer: Literal["thread", "process"], rank: int) -> None:
    root, node = out / "replicas-root", out / f"replicas-node{rank}"
    kw: dict[str, Any] = {"local": node, "replicas": 1, "persist_every": 2, "commit_timeout_s": 60, "writer": writer}
    with CheckpointManager(root, local_keep=2, keep_last=1, **kw) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state(step, rank))
        mgr.wait_persisted()
        check("replicas: steps 1 and 3 uploaded", mgr.persisted_steps == [1, 3], mgr.persisted_steps)
    dist.barrier()
    check("replicas: each node keeps the 2 newest steps", steps(node) == [3, 4], steps(node))
    check("replicas: the persistent root keeps the newest", steps(root) == [3], steps(root))
    lose(node, rank == 1)
    with CheckpointManager(root, **{**kw, "writer": "thread"}) as mgr:
        restored("replicas", mgr, 4, rank)


def erasure(out: Path, writer: Literal["thread", "process"], rank: int) -> None:
    root, node = out / "erasure-root", out / f"erasure-node{rank}"
    kw: dict[str, Any] = {"local": node, "erasure": (2, 1), "persist_every": 100, "commit_timeout_s": 60}
    with CheckpointManager(root, writer=writer, **kw) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step, rank))
    lose(node, rank == 2)
    with CheckpointManager(root, **kw) as mgr:
        restored("erasure", mgr, 2, rank)


def main() -> None:
    out, writer = Path(sys.argv[1]), cast('Literal["thread", "process"]', sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks.run("replicas=1: save, upload, retention, restore after a node's loss", lambda: replicas(out, writer, rank))
    dist.barrier()
    checks.run("erasure=(2, 1): a lost node rebuilt from parity", lambda: erasure(out, writer, rank))
    checks.write(out / f"checks-r{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
