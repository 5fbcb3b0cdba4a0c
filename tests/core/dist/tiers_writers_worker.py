"""Two jobs with local tiers on one persistent root: 2 gloo ranks, each rank a job of its own
(``process_group="local"``) with its own local directory; the default group only orders them.

    tiers_writers_worker.py MODE OUT CONFIG_JSON

- ``two_writers``: job A saves step 1 (``persist_every=1``; its upload made slow: the
  persistent root's manifest put waits ``commit_delay_s``), then job B saves step 1 while
  that upload runs. B's ``wait()`` raises ``StepClaimedError`` naming both writers, and B's
  local tier holds no step 1; A's upload commits.
- ``zombie``: job A (the zombie) persists step 1 and saves step 2, whose upload is held at
  its first data file until B says go. Job B (the restarted job, on a new node) restores step 1
  and takes over A's claim of step 2, saves step 2 (local only) and step 3 (persisted). A's
  upload of step 2 is then refused, naming B; the persistent root holds B's step 3 and no step
  2, and a fresh node restores B's step 3 bit for bit.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointError, CheckpointManager, StepClaimedError
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.storage.wrapper import StorageWrapper
from tests.checks import Checks
from tests.core.dist.slow_storage import Slow

checks = Checks()
check = checks.check


class HeldUpload(StorageWrapper):
    """A root whose writes of step 2's data files wait until ``gate`` exists."""

    def __init__(self, inner: Any, gate: Path) -> None:
        super().__init__(inner)
        self.gate = gate

    def open_writer(self, path: str) -> Any:
        if path.startswith("step-000000000002/data/"):
            deadline = time.monotonic() + 120
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.inner.open_writer(path)


def state(step: int, job: str) -> dict[str, Any]:
    torch.manual_seed(step * 10 + (job == "B"))
    return {"w": torch.randn(64, 64), "step": step, "job": job}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(64, 64), "step": -1, "job": ""}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return bool(torch.equal(got["w"], want["w"])) and got["step"] == want["step"] and got["job"] == want["job"]


def manager(root: Any, local: str, **extra: Any) -> CheckpointManager:
    return CheckpointManager(root, local=local, process_group="local", commit_timeout_s=60, **extra)


def two_writers(cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    root, node0, node1 = cfg["root"], cfg["locals"][0], cfg["locals"][1]
    if rank == 0:  # job A
        mgr = manager(Slow(LocalStorage(root), cfg["commit_delay_s"]), node0, persist_every=1)
        try:
            mgr.save(1, state(1, "A")).wait()
            check("A: save 1 acknowledged", True)
        except CheckpointError as e:
            check("A: save 1 acknowledged", False, f"{type(e).__name__}: {e}")
        dist.barrier()  # B saves step 1 while A's upload runs
        dist.barrier()
        try:
            mgr.wait_persisted()
            check("A: step 1 persisted", mgr.persisted_steps == [1], mgr.persisted_steps)
        except CheckpointError as e:
            check("A: step 1 persisted", False, f"{type(e).__name__}: {e}")
        mgr.close()
    else:  # job B, the same configuration copied
        mgr = manager(root, node1, persist_every=1)
        dist.barrier()
        try:
            mgr.save(1, state(1, "B")).wait()
            check("B: save 1 refused at wait()", False, "acknowledged: both writers of step 1 were")
        except StepClaimedError as e:
            said = str(e)
            both = node0 in said and node1 in said and "claimed by another writer" in said
            check("B: save 1 refused at wait(), naming both writers", both, said)
            check("B: the remedy is named", "stop the other one, or save under another root" in said, said)
        except CheckpointError as e:
            check("B: save 1 refused at wait()", False, f"{type(e).__name__}: {e}")
        dist.barrier()
        local_manifest = Path(node1, "step-000000000001", "manifest.json")
        check("B: step 1 not committed in B's local tier", not local_manifest.exists())
        try:
            mgr.close()
            check("B: close() raises nothing more", True)
        except CheckpointError as e:
            check("B: close() raises nothing more", False, f"{type(e).__name__}: {e}")


def zombie(cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    root, node0, node1 = cfg["root"], cfg["locals"][0], cfg["locals"][1]
    gate = Path(cfg["root"] + ".go")
    if rank == 0:  # job A: still running after its job was restarted elsewhere
        mgr = manager(HeldUpload(LocalStorage(root), gate), node0, persist_every=1)
        mgr.save(1, state(1, "A")).wait()
        mgr.wait_persisted()
        mgr.save(2, state(2, "A")).wait()  # committed locally; its upload held
        dist.barrier()
        dist.barrier()  # B took step 2 over, saved it and opened the gate
        try:
            mgr.wait_persisted()
            check("A: its upload of step 2 refused", False, "uploaded: the zombie's step 2 reached the root")
        except StepClaimedError as e:
            said = str(e)
            check("A: its upload of step 2 refused, naming B", node1 in said and "step 2" in said, said)
        except CheckpointError as e:
            check("A: its upload of step 2 refused, naming B", False, f"{type(e).__name__}: {e}")
        try:
            mgr.close()
        except CheckpointError:
            pass
        dist.barrier()
    else:  # job B: the restart, on a new node (an empty local directory)
        dist.barrier()
        mgr = manager(root, node1, persist_every=2)
        got = blank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = mgr.restore(got)
        check("B: restores step 1 from the persistent root", restored == 1 and same(got, state(1, "A")), restored)
        said = " ".join(str(w.message) for w in caught)
        check("B: takes over A's claim of step 2, naming A", "takes over 1 step claim" in said and node0 in said, said)
        try:
            mgr.save(2, state(2, "B")).wait()
            mgr.save(3, state(3, "B")).wait()
            check("B: saves 2 and 3 acknowledged", True)
        except CheckpointError as e:
            check("B: saves 2 and 3 acknowledged", False, f"{type(e).__name__}: {e}")
        gate.write_text("go")
        dist.barrier()
        try:
            mgr.wait_persisted()
            check("B: step 3 persisted", mgr.persisted_steps == [3], mgr.persisted_steps)
        except CheckpointError as e:
            check("B: step 3 persisted", False, f"{type(e).__name__}: {e}")
        mgr.close()
        dist.barrier()  # A's upload ended
        shutil.rmtree(node1)  # B's node replaced: only the persistent root is left
        steps = sorted(p.name for p in Path(root).glob("step-*") if (p / "manifest.json").exists())
        check(
            "the root holds steps 1 and 3, not A's step 2", steps == ["step-000000000001", "step-000000000003"], steps
        )
        with CheckpointManager(root, process_group="local") as fresh:
            got = blank()
            restored = fresh.restore(got)
        check("a fresh node restores B's step 3 bit for bit", restored == 3 and same(got, state(3, "B")), restored)


def main() -> None:
    mode, out, cfg = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    {"two_writers": two_writers, "zombie": zombie}[mode](cfg)
    checks.write(out / f"checks-r{dist.get_rank()}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
