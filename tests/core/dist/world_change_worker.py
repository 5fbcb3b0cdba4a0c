"""Plain-torch per-rank state saved at one world size and restored at another.

    world_change_worker.py save OUT        (any number of ranks)
    world_change_worker.py resume OUT [POLICY]

``save``: every rank seeds its RNGs with its rank, trains a replicated model one step, and
saves model, optimizer, ``RNGState()`` and ``PerRank(<a tensor of its rank>)`` at step 5;
rank r writes its RNG state and per-rank tensor to ``OUT/saved-<r>.pt`` (rank 0 the model and
optimizer too). ``resume``: other seeds, then ``mgr.restore(state)`` (or
``restore(state, per_rank=POLICY)``), and records the step, the model and optimizer against
the save bit for bit, which saved rank's RNG and per-rank tensor each rank got, the warnings
and the error, in ``OUT/resume-<world>-<policy>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardkeeper.core import CheckpointManager, PerRank, RNGState

MODE, OUT = sys.argv[1], sys.argv[2]
POLICY = sys.argv[3] if len(sys.argv) > 3 else None
STEP = 5


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def main() -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    root = os.path.join(OUT, "root")
    if MODE == "save":
        model, opt = build(0)  # the same replica on every rank
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        torch.manual_seed(100 + rank)  # each rank its own RNG stream
        own = torch.full((3,), float(rank))
        with CheckpointManager(root, async_save=False) as mgr:
            mgr.save(STEP, {"model": model, "optim": opt, "rng": RNGState(), "own": PerRank(own)})
        torch.save({"rng": torch.get_rng_state(), "own": own, "state": flat(model, opt)}, f"{OUT}/saved-{rank}.pt")
    else:
        model, opt = build(7)
        model(torch.ones(3, 4)).sum().backward()
        opt.step()  # an optimizer state to overwrite
        torch.manual_seed(900 + rank)
        mine = torch.get_rng_state()
        own = torch.full((3,), -1.0)
        state = {"model": model, "optim": opt, "rng": RNGState(), "own": PerRank(own)}
        got: dict[str, object] = {"error": None, "step": None}
        with warnings.catch_warnings(record=True) as caught, CheckpointManager(root) as mgr:
            warnings.simplefilter("always")
            try:
                got["step"] = mgr.restore(state, per_rank=POLICY)
            except Exception as e:
                got["error"] = f"{type(e).__name__}: {e}"
        got["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "world size" in str(w.message)]
        n = len([f for f in os.listdir(OUT) if f.startswith("saved-")])
        saved = [torch.load(f"{OUT}/saved-{r}.pt") for r in range(n)]
        want = saved[0]["state"]
        now = flat(model, opt)
        got["bit_exact"] = now.keys() == want.keys() and all(torch.equal(now[k], want[k]) for k in want)
        rng = torch.get_rng_state()
        kept_rng, kept_own = torch.equal(rng, mine), bool((own == -1).all())
        got["rng_from"] = next(
            (r for r, s in enumerate(saved) if torch.equal(s["rng"], rng)), "own" if kept_rng else None
        )
        got["own_from"] = next(
            (r for r, s in enumerate(saved) if torch.equal(s["own"], own)), "own" if kept_own else None
        )
        with open(f"{OUT}/resume-{world}-{POLICY}-{rank}.json", "w") as f:
            json.dump(got, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
