"""Overlapped staging on real gloo ranks (run under torchrun with 2 ranks).

    overlap_worker.py ROOT

For each layout (DDP, FSDP2, TP; FSDP1 too, whose sharded state dict holds no live optimizer
storage, so nothing is deferred and overlap behaves as blocking), with ``staging="overlap"``: the next ``optimizer.step()``
right after ``save()`` returns, a direct in-place change after ``wait_staged()``, a direct
change racing the copy (refused on every rank), and gradient accumulation (forward and
backward while the copy is held back: no wait). The checkpoint must hold the pre-save values
bit for bit. Each rank writes ``ROOT/results/overlap-r<R>.json``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import batch, build, full_state, train_step  # noqa: E402

from shardkeeper.core import CheckpointManager, CheckpointSaveError  # noqa: E402
from shardkeeper.core.save import overlap
from tests.checks import Checks, state_diff  # noqa: E402

LAYOUTS = ("plain", "fsdp2", "tp", "fsdp1")
checks = Checks()


def restored(mgr: CheckpointManager, layout: str, step: int) -> dict[str, torch.Tensor]:
    model, opt = build(layout, seed=50 + step)
    train_step(model, opt, 999)  # optimizer state exists, with other values
    mgr.restore({"model": model, "optim": opt}, step=step)
    return full_state(model, opt)


def local_ptrs(model: torch.nn.Module) -> list[int]:
    out = []
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out.append(t.untyped_storage().data_ptr())
    return out


def run_layout(root: Path, layout: str) -> None:
    model, opt = build(layout, seed=1)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    release = threading.Event()
    defers = layout != "fsdp1"
    with CheckpointManager(root / layout, staging="overlap") as mgr:
        # 1. optimizer.step() right after save() returns.
        ref = full_state(model, opt)
        ptrs = local_ptrs(model)
        h = mgr.save(1, state)
        checks.check(f"{layout}: parameters and optimizer state are deferred", (h.deferred_bytes > 0) == defers,
                     str(h.deferred_bytes))
        train_step(model, opt, 1)
        checks.check(f"{layout}: the step waited", mgr.staging_waits == int(defers), str(mgr.staging_waits))
        h.wait()
        checks.check(f"{layout}: local parameter storage persists across steps", local_ptrs(model) == ptrs)
        checks.same(f"{layout}: step after save: checkpoint holds pre-save values", restored(mgr, layout, 1), ref)
        checks.check(f"{layout}: step changed the live state (control)", state_diff(full_state(model, opt), ref),
                     "no difference")

        # 2. A direct in-place change after wait_staged().
        ref = full_state(model, opt)
        h = mgr.save(2, state)
        mgr.wait_staged()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        h.wait()
        checks.same(f"{layout}: direct change after wait_staged: pre-save values", restored(mgr, layout, 2), ref)

        # 3. The same change racing the held-back copy: refused on every rank, not torn.
        overlap._before_copy = lambda: release.wait(60)
        try:
            h = mgr.save(3, state)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            release.set()
            try:
                h.wait()
                checks.check(f"{layout}: racing change refused", not defers, "save committed")
            except CheckpointSaveError as e:
                checks.check(f"{layout}: racing change refused",
                             defers and "modified in place" in str(e) and "step 3" in str(e), str(e))
            dist.barrier()
            checks.check(f"{layout}: racing change: not committed", (3 not in mgr.steps()) == defers, str(mgr.steps()))

            # 4. Gradient accumulation while the copy is held back: forward/backward, no wait.
            release.clear()
            ref = full_state(model, opt)
            waits = mgr.staging_waits
            h = mgr.save(4, state)
            for i in (10, 11):
                x, y = batch(i)
                (model(x) - y).pow(2).mean().backward()
            checks.check(f"{layout}: accumulation ran while staging was pending",
                         h.staged() != defers and mgr.staging_waits == waits)
            release.set()
            opt.step()
            opt.zero_grad()
            h.wait()
            checks.same(f"{layout}: accumulation then step: pre-save values", restored(mgr, layout, 4), ref)
        finally:
            release.set()
            overlap._before_copy = None


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for layout in LAYOUTS:
        checks.guard(f"{layout}: whole case", lambda layout=layout: run_layout(root, layout))
        dist.barrier()
    checks.write(root / "results" / f"overlap-r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
