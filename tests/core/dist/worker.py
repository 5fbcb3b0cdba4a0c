"""Multi-process worker for the layout matrix (run under torchrun, or plainly for world 1).

    worker.py save ROOT           # train each layout 3 steps, save, write the references
    worker.py restore ROOT        # restore every saved checkpoint into every layout

Each rank writes ``ROOT/results/<phase>-w<W>-r<R>.json``: its checks (``tests.checks.Checks``).
A check compares full parameters and AdamW state bit for bit with the reference written at
save time; where the layout and world size match the saver's, it also trains one more step
and compares the loss with the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fragments  # noqa: E402
from layouts import LAYOUTS, build, full_state, supported, train_step  # noqa: E402

from shardkeeper.core import CheckpointManager, PerRank, RNGState  # noqa: E402
from tests.checks import Checks, state_diff  # noqa: E402

STEPS = 3


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _layouts_here(world: int) -> list[str]:
    wanted = os.environ.get("SK_LAYOUTS")
    names = wanted.split(",") if wanted else list(LAYOUTS)
    if world == 1:
        names = [n for n in names if n == "plain"]
    return [n for n in names if supported(n, world)]


def phase_save(root: Path, checks: Checks) -> None:
    rank, world = _world()
    for layout in _layouts_here(world):
        name = f"{layout}-w{world}"
        model, opt = build(layout, seed=1)
        for i in range(STEPS - 1):
            train_step(model, opt, i)
        # A digest block that divides no row: resharded reads must widen to blocks and verify.
        # DTensors and FSDP1's ShardedTensors are described by their layout rule at world
        # sizes 2 and 4 and enumerated at 3 (the default at this size), so restores cover both
        # forms of the manifest.
        describe = True if world in (2, 4) else None
        with CheckpointManager(root / name, digest_block_bytes=3000, describe_layouts=describe) as mgr:
            def state(step: int) -> dict:
                return {"model": model, "optim": opt, "progress": {"step": step}, "rng": RNGState(),
                        "note": PerRank({"rank": rank})}

            # Saved at STEPS - 1 and, after one more step, at STEPS: the second save binds the
            # changed tensors into the cached plan (plain tensors and DTensors, uneven shards
            # included; FSDP1's ShardedTensors are planned afresh), and restores compare it.
            mgr.save(STEPS - 1, state(STEPS - 1), async_save=world != 3).wait()
            train_step(model, opt, STEPS - 1)
            if world == 3:  # synchronous: written from the tensors' own memory, no staging copy
                mgr.save(STEPS, state(STEPS), async_save=False)
                ref = full_state(model, opt)
            else:
                h = mgr.save(STEPS, state(STEPS))
                ref = full_state(model, opt)  # runs while the save writes in the background
                h.wait()
            hits = mgr._plans.hits
        next_loss = train_step(model, opt, STEPS)
        if rank == 0:
            from safetensors.torch import save_file

            save_file(ref, str(root / f"{name}.ref.safetensors"))
            (root / f"{name}.json").write_text(json.dumps({"next_loss": next_loss, "world": world, "layout": layout}))
        want = 0 if layout == "fsdp1" else 1
        checks.check(name, hits == want, f"plan cache hits {hits}, expected {want}")
        manifest = json.loads((root / name / f"step-{STEPS:012d}" / "manifest.json").read_text())
        described = manifest.get("described", {}).get("keys", [])
        expect = describe is True and layout in ("fsdp1", "fsdp2", "tp", "fsdp2_tp")
        checks.check(
            f"{name}: chunks {'described' if expect else 'enumerated'}",
            bool(described) == expect and ("described" in manifest.get("requires", [])) == expect,
            f"requires {manifest.get('requires')}, described keys {described[:4]}",
        )
        if expect and layout != "tp":  # (TP leaves some modules plain: replicated, enumerated)
            # every weight and moment, FSDP2+TP's non-TP ones on DP submeshes included
            sharded = [k for k in manifest.get("leaf_table", {}).get("keys", [])
                       if k.startswith(("model/", "optim/state/")) and not k.endswith(("/step", "model/scale"))]
            checks.check(f"{name}: every weight and moment described", sharded == [], f"enumerated {sharded[:4]}")
    frags, _ = fragments.partition(world, rank, fill=True)
    # Described by the flat-partition rule at world sizes 2 and 4, enumerated at 3.
    describe = True if world in (2, 4) else None
    with CheckpointManager(root / f"fragments-w{world}", digest_block_bytes=3000, describe_layouts=describe) as mgr:
        mgr.save(1, dict(frags))
    manifest = json.loads((root / f"fragments-w{world}" / "step-000000000001" / "manifest.json").read_text())
    described = manifest.get("described", {}).get("keys", [])
    want = sorted(fragments.tensors()) if describe else []
    checks.check(f"fragments-w{world}: {'described' if describe else 'enumerated'}", described == want, f"described {described}")


def restore_fragments(root: Path, checks: Checks) -> None:
    """Every ZeRO-style checkpoint into fragments, plain tensors and Shard(0) DTensors here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank, world = _world()
    ref = fragments.tensors()
    for src in sorted(p.name for p in root.iterdir() if p.name.startswith("fragments-w")):
        targets: dict[str, dict] = {}
        frags, _ = fragments.partition(world, rank, fill=False)
        targets["fragments"] = frags
        targets["plain"] = {k: torch.full_like(t, float("nan")) for k, t in ref.items()}
        if world > 1:
            mesh = init_device_mesh("cpu", (world,))
            targets["dtensor"] = {
                k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)] if t.dim() else [Replicate()])
                for k, t in ref.items()
            }
        for kind, state in targets.items():
            case = f"{src} -> {kind}-w{world}"

            def one(kind: str = kind, state: dict = state, case: str = case) -> None:
                with CheckpointManager(root / src) as mgr:
                    mgr.restore(state)
                if kind == "fragments":
                    got = fragments.gather(state)
                elif kind == "dtensor":
                    got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
                else:
                    got = state
                checks.same(case, got, ref)

            checks.guard(case, one)


def phase_restore(root: Path, checks: Checks) -> None:
    from safetensors.torch import load_file

    rank, world = _world()
    sources = sorted(
        p.name for p in root.iterdir()
        if p.is_dir() and "-w" in p.name and p.name != "results" and not p.name.startswith("fragments")
    )
    # Negative control: a model that was not restored must fail the comparison, or the
    # comparison proves nothing.
    model, opt = build("plain", seed=2)
    train_step(model, opt, 0)
    control = state_diff(full_state(model, opt), load_file(str(root / f"{sources[0]}.ref.safetensors")))
    checks.check("control: unrestored model differs", bool(control), "no difference found")
    for src in sources:
        info = json.loads((root / f"{src}.json").read_text())
        ref = load_file(str(root / f"{src}.ref.safetensors"))
        for layout in _layouts_here(world):
            case = f"{src} -> {layout}-w{world}"

            def one(layout: str = layout, case: str = case, info: dict = info, ref: dict = ref) -> None:
                model, opt = build(layout, seed=2)
                note = PerRank({"rank": -1})
                state = {"model": model, "optim": opt, "progress": {"step": 0}, "rng": RNGState(), "note": note}
                with CheckpointManager(root / src, per_rank="modulo") as mgr:
                    step = mgr.restore(state)
                    stats = mgr.last_restore_stats
                problems = [d for d in [state_diff(full_state(model, opt), ref)] if d]
                if step != STEPS or state["progress"]["step"] != STEPS:
                    problems.append(f"restored step {step}, progress {state['progress']}")
                if note.value["rank"] != rank % info["world"]:
                    problems.append(f"per-rank note {note.value} for rank {rank}")
                if layout == info["layout"] and world == info["world"]:
                    loss = train_step(model, opt, STEPS)
                    if loss != info["next_loss"]:
                        problems.append(f"next loss {loss!r} != uninterrupted {info['next_loss']!r}")
                checks.check(case, not problems, "\n".join(problems), bytes_direct=stats.bytes_direct if stats else 0)

            checks.guard(case, one)
    restore_fragments(root, checks)


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = _world()
    torch.set_num_threads(1)
    checks = Checks(root / "results" / f"{phase}-w{world}-r{rank}.json", rank=rank)
    checks.guard(f"{phase} (whole phase)", lambda: (phase_save if phase == "save" else phase_restore)(root, checks))
    checks.write()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
