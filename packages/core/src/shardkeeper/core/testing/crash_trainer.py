"""The trainer of a crash trial (``crash_trial``): one rank, launched by torchrun (or alone).

    python -m shardkeeper.core.testing.crash_trainer save ROOT OUT --steps K --victim V --writer W
        [--kill-after all|own] [--commit-timeout S]
    python -m shardkeeper.core.testing.crash_trainer restore ROOT OUT [--commit-timeout S]

``save``: saves ``rank_state(step, rank)`` for steps 1..K back to back (``save()`` only, as a
training loop does; each save may still commit while the next is made). After each ``save()``
returns, the rank rewrites ``OUT/save.r<rank>.json`` (the steps whose ``save()`` returned, and
its persist process's pid). Rank V's trainer SIGKILLs itself right after the ``save()`` of step K
returned on every rank (``all``: it polls the ranks' records every millisecond, the precondition
of the guarantee under test) or on itself (``own``); the other ranks go on to the next
collective, where torchrun tears them down.
``restore``: a fresh trainer reads ``latest_step()``, restores the newest step into zeroed
tensors and writes ``OUT/restore.r<rank>.json``: the step, whether every tensor equals
``rank_state`` of it bit for bit, and how long ``latest_step()`` waited.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkeeper.core.testing.trial_checks import deterministic_state

if TYPE_CHECKING:
    from shardkeeper.core import CheckpointManager


def rank_state(step: int, rank: int, tensor_bytes: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step``: half its bytes replicated (a function of the step), half
    its own (of the step and the rank, under ``own``, saved as ``PerRank``)."""
    import torch

    model = deterministic_state(step, max(4, tensor_bytes // 2))["model"]
    g = torch.Generator().manual_seed(7_919 * step + 104_729 * rank + 3)
    own = torch.randn(max(1, tensor_bytes // 8), generator=g)
    return {"model": model, "own": own, "step": step}


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    from shardkeeper.core import PerRank

    return {**state, "own": PerRank(state["own"])}


def _write_json(path: Path, obj: Any) -> None:
    """``obj`` to ``path`` whole or not at all (a kill right after leaves the file complete)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _save(mgr: CheckpointManager, out: Path, rank: int, a: argparse.Namespace) -> None:
    record: dict[str, Any] = {"rank": rank, "returned": [], "persist_pids": []}
    for step in range(1, a.steps + 1):
        mgr.save(step, _saved(rank_state(step, rank, a.tensor_bytes)))
        record["returned"].append(step)
        pid = getattr(mgr._saver, "pid", None)  # the persist process that holds this save
        if pid and pid not in record["persist_pids"]:
            record["persist_pids"].append(pid)
        _write_json(out / f"save.r{rank}.json", record)
    if rank == a.victim:
        if a.kill_after == "all":
            _await_others(out, a.steps)
        os.kill(os.getpid(), signal.SIGKILL)
    _next_collective()
    mgr.close()


def _await_others(out: Path, step: int, timeout_s: float = 120.0) -> None:
    """Until every rank's record lists ``step`` (its ``save()`` returned), polled every
    millisecond; past ``timeout_s``, go on (the trial then finds a rank whose save did not return)."""
    import torch.distributed as dist

    paths = [out / f"save.r{r}.json" for r in range(dist.get_world_size() if dist.is_initialized() else 1)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(step in _returned(p) for p in paths):
            return
        time.sleep(0.001)


def _returned(path: Path) -> list[int]:
    try:
        return list(json.loads(path.read_text()).get("returned", []))
    except (OSError, ValueError):
        return []


def _next_collective() -> None:
    """Where the survivors wait: the next step's collective, which the victim never joins."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _restore(manager: CheckpointManager, out: Path, rank: int, tensor_bytes: int) -> None:
    import torch

    result: dict[str, Any] = {"rank": rank}
    try:
        with manager as mgr:
            t0 = time.monotonic()
            latest = mgr.latest_step()
            result["latest_wait_s"] = round(time.monotonic() - t0, 3)
            result["latest"] = latest
            if latest is not None:
                want = rank_state(latest, rank, tensor_bytes)
                blank = {
                    "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                    "own": torch.zeros_like(want["own"]),
                    "step": -1,
                }
                target = _saved(blank)
                result["restored"] = mgr.restore(target)
                got = {**target, "own": target["own"].value}
                result["exact"] = bool(
                    got["step"] == latest
                    and torch.equal(got["own"], want["own"])
                    and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
                )
    except Exception as e:
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    _write_json(out / f"restore.r{rank}.json", result)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardkeeper.core.testing.crash_trainer")
    p.add_argument("mode", choices=("save", "restore"))
    p.add_argument("root")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--victim", type=int, default=0)
    p.add_argument("--writer", default="process")
    p.add_argument("--kill-after", choices=("all", "own"), default="all")
    p.add_argument("--tensor-bytes", type=int, default=1 << 20)
    p.add_argument("--commit-timeout", type=float, default=1800.0, help="the managers' commit_timeout_s")
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from shardkeeper.core import CheckpointManager

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if a.mode == "save":
        mgr = CheckpointManager(a.root, writer=a.writer, commit_timeout_s=a.commit_timeout)
        _save(mgr, a.out, rank, a)
    else:
        _restore(CheckpointManager(a.root, commit_timeout_s=a.commit_timeout), a.out, rank, a.tensor_bytes)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ teardown, which now and then aborts a process that is done


__all__ = ["main", "rank_state"]


if __name__ == "__main__":
    main()
