"""Saves written by persist processes (``writer="process"``) across ranks.

    persist_worker.py RESULTS MODE ROOT

MODE ``saves``: every rank saves its own tensors and a shared one back to back (async, the
next save started while the previous one still commits), with zstd and incremental codecs,
then restores bit for bit; the persist processes are gone after ``close()``.
MODE ``kill``: step 1 and 2 are saved and waited for, step 3 is saved and the rank given by
``SHARDKEEPER_TEST_KILL_RANK`` SIGKILLs itself right after ``save()`` returns; the other ranks
wait in a barrier (torchrun then tears them down). Each rank writes its expected step-3 state
to ``ROOT.expect.<rank>.pt`` first (a test-only file, saved with ``torch.save``) and its
persist process's pid to ``ROOT.pid.<rank>``.
MODE ``persist-kill``: rank 1's persist process is killed before it writes step 2: both
ranks' saves fail at once (not after the commit timeout), and step 3 commits.
MODE ``mixed``: rank 0 passes ``writer="process"``, rank 1 the thread writer: refused on both.
MODE ``resume``: a fresh trainer restores the newest step and checks it is step 3, bit for bit.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkeeper.core import CheckpointManager, PerRank
from tests.checks import Checks, assert_same_state


def state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` saves at ``step``: replicated tensors, and one of its own (``own``)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "shared": torch.full((256, 64), float(step)),
        "own": torch.randn(512, 128, generator=g),
        "big": torch.randn(1 << 20, generator=torch.Generator().manual_seed(step)),
    }


def saved(tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    return {**{k: v for k, v in tensors.items() if k != "own"}, "own": PerRank(tensors["own"])}


def restored(target: dict[str, object]) -> dict[str, torch.Tensor]:
    return {k: v.value if isinstance(v, PerRank) else v for k, v in target.items()}  # type: ignore[misc]


def main(results: Path, mode: str, root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = Checks(results / f"{mode}.r{rank}.json", rank=rank)
    opts = {"writer": os.environ.get("SHARDKEEPER_TEST_WRITER", "process"), "min_file_bytes": 1 << 16}
    if mode == "saves":

        def saves() -> None:
            with CheckpointManager(root, incremental=True, compression="zstd", keep_last=2, **opts) as mgr:
                for step in (1, 2, 3):
                    mgr.save(step, {"s": saved(state(rank, step))})  # the previous save may still commit
                pid = mgr._saver.pid
                mgr.wait()
                # (retention runs on the coordinator after it publishes the outcome: the other
                # ranks' wait() may return before step 1 is deleted)
                if rank == 0:
                    assert mgr.steps() == [2, 3], mgr.steps()
            assert pid is not None
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                pass
            else:
                raise AssertionError(f"the persist process {pid} outlived close()")
            target = {"s": saved({k: torch.zeros_like(v) for k, v in state(rank, 3).items()})}
            with CheckpointManager(root) as mgr:
                assert mgr.restore(target) == 3
            assert_same_state(restored(target["s"]), state(rank, 3), what="step 3")

        checks.run("back-to-back saves by persist processes, restored bit for bit", saves)
    elif mode == "kill":
        victim = int(os.environ["SHARDKEEPER_TEST_KILL_RANK"])
        torch.save(state(rank, 3), f"{root}.expect.{rank}.pt")
        mgr = CheckpointManager(root, **opts)
        mgr.save(1, {"s": saved(state(rank, 1))}).wait()
        mgr.save(2, {"s": saved(state(rank, 2))}).wait()
        Path(f"{root}.pid.{rank}").write_text(str(getattr(mgr._saver, "pid", None) or 0))
        dist.barrier()
        mgr.save(3, {"s": saved(state(rank, 3))})
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # never passes: torchrun tears this rank down
    elif mode == "persist-kill":

        def persist_killed() -> None:
            import time

            from shardkeeper.core import CheckpointSaveError

            with CheckpointManager(root, commit_timeout_s=600.0, **opts) as mgr:
                mgr.save(1, {"s": saved(state(rank, 1))}).wait()
                dist.barrier()
                t0 = time.monotonic()
                h = mgr.save(2, {"s": saved(state(rank, 2))})
                if rank == 1:  # stopped before it can write, then killed: it never reports
                    pid = mgr._saver.pid
                    assert pid is not None
                    os.kill(pid, signal.SIGSTOP)
                    os.kill(pid, signal.SIGKILL)
                try:
                    h.wait()
                except CheckpointSaveError as e:
                    text = str(e)
                    assert "step 2" in text and ("rank 1" in text), text
                    if rank == 1:
                        assert "SIGKILL" in text, text
                else:
                    raise AssertionError("the save whose rank-1 persist process was killed committed")
                waited = time.monotonic() - t0
                print(f"rank {rank}: failure heard after {waited:.1f} s", flush=True)
                assert waited < 120, f"rank {rank} heard of the failure only after {waited:.0f} s"
                mgr.save(3, {"s": saved(state(rank, 3))}).wait()  # a new persist process on rank 1
                assert mgr.steps() == [1, 3], mgr.steps()

        checks.run(
            "a killed persist process fails its save on every rank at once; the next save commits", persist_killed
        )
    elif mode == "mixed":

        def mixed() -> None:
            try:
                CheckpointManager(root, writer="process" if rank == 0 else "thread")
            except ValueError as e:
                assert "some ranks passed writer='process' and others did not" in str(e), e
                assert f"rank {rank}" in str(e), e
            else:
                raise AssertionError("a manager of mixed writers was made")

        checks.run("ranks that pass different writers are refused on every rank", mixed)
    elif mode == "resume":

        def resume() -> None:
            target = {"s": saved({k: torch.zeros_like(v) for k, v in state(rank, 3).items()})}
            with CheckpointManager(root) as mgr:
                assert mgr.latest_step() == 3, mgr.latest_step()
                assert mgr.restore(target) == 3
            assert_same_state(
                restored(target["s"]), torch.load(f"{root}.expect.{rank}.pt"), what="step 3 after the kill"
            )

        checks.run("a fresh trainer restores the step saved right before the kill", resume)
    checks.write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
