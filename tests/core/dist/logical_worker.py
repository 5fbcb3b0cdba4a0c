"""Logical digests on a real process group (tests/core/save/test_logical_digest.py).

    logical_worker.py ROOT RESULTS

At 3 ranks: an FSDP2 model (every parameter and optimizer state a Shard(0) DTensor, uneven
over 3) and a TP one (ColwiseParallel: row shards, RowwiseParallel: column shards), each with
a plain tensor, a replicated DTensor, a bytes leaf and a per-rank tensor beside it, saved
enumerated (``describe_layouts=False``), described, and described with group commit
(``commit_group_ranks=2``: rank 1 leads ranks 1 and 2 and adds their sums). In every manifest each
tensor leaf's logical digest equals ``logical_digest`` of the full tensor, and every rank's
``logical_partial`` of its DTensor, combined, equals it too. Each rank writes its checks to
``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from layouts import build, full_state, train_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from shardkeeper.core import CheckpointManager, PerRank, logical_combine, logical_digest, logical_partial
from shardkeeper.core.format.logical_member import digests_of
from tests.checks import Checks

RUNS = {
    "enumerated": {"describe_layouts": False},
    "described": {"describe_layouts": True},
    "grouped": {"describe_layouts": True, "commit_group_ranks": 2},
}


def main(root: Path, results: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(results / f"r{rank}.json", rank=rank)
    mesh = init_device_mesh("cpu", (world,))
    step = 0
    for layout in ("fsdp2", "tp"):
        model, opt = build(layout, seed=7)
        train_step(model, opt, 0)
        full = full_state(model, opt)  # a collective: every rank
        g = torch.Generator().manual_seed(11)
        plain, norm = torch.randn(5, 3, generator=g), torch.randn(9, generator=g).to(torch.bfloat16)
        extra = {"plain": plain, "norm": distribute_tensor(norm, mesh, [Replicate()]), "blob": b"\x00\x01logical"}
        mine = torch.full((4,), float(rank))
        full.update(
            {
                "extra/plain": plain,
                "extra/norm": norm,
                "extra/blob": torch.frombuffer(bytearray(b"\x00\x01logical"), dtype=torch.uint8),
                f"ranks/{rank}/mine": mine,
            }
        )
        for name, options in RUNS.items():
            step += 1
            case = f"{layout} {name}"
            state = {"model": model, "optim": opt, "extra": extra, "ranks": PerRank({"mine": mine})}

            def save_and_check(
                state: dict[str, Any] = state,
                options: dict[str, Any] = options,
                step: int = step,
                case: str = case,
                full: dict[str, torch.Tensor] = full,
            ) -> None:
                with CheckpointManager(root / case.replace(" ", "-"), **options) as mgr:
                    mgr.save(step, state, async_save=False)
                    m = mgr.manifest(step)
                digests = digests_of(m.logical, m.leaves)
                assert digests is not None, f"{case}: the manifest has no logical digests ({m.logical!r})"
                missing = sorted(k for k, d in digests.items() if d is None)
                assert not missing, f"{case}: leaves without a digest: {missing[:5]}"
                described = m.leaves.described is not None if hasattr(m.leaves, "described") else False
                assert described == bool(options["describe_layouts"]), f"{case}: described leaves {described}"
                compared = [k for k in full if k in digests]
                assert len(compared) >= 10, f"{case}: only {compared} compared"
                wrong = [k for k in compared if digests[k] != logical_digest(full[k])]
                assert not wrong, f"{case}: the manifest's digest is not the full tensor's for {wrong[:5]}"
                others = [k for k in digests if k not in full and not k.startswith("ranks/")]
                assert not others, f"{case}: leaves not compared: {others[:5]}"

            checks.run(f"{case}: every digest is the full tensor's", save_and_check)

        def partials(model: Any = model, layout: str = layout, full: dict[str, torch.Tensor] = full) -> None:
            for fqn, p in model.named_parameters():
                if hasattr(p, "device_mesh"):
                    part = logical_partial(p)
                else:  # a plain (replicated) tensor: rank 0's counts
                    part = logical_partial(p.detach(), (0,) * p.dim(), p.shape) if rank == 0 else None
                got: list[Any] = [None] * world
                dist.all_gather_object(got, part)
                key = f"model/{fqn}"
                want = logical_digest(full[key])
                combined = logical_combine(x for x in got if x is not None)
                assert combined == want, f"{layout}: {key}'s partials do not combine to its digest"

        checks.run(f"{layout}: the ranks' partials combine to the digest", partials)
    checks.write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
