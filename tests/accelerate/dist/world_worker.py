"""A real Accelerator(cpu=True) saved at one world size and resumed at another.

``world_worker.py save OUT``: trains 3 steps with dropout (per-rank RNG, per-rank DataLoader
positions), ``save_state()`` after step 3, and writes the unwrapped model's parameters and
the optimizer's state to ``OUT/saved-<rank>.pt``. ``world_worker.py resume OUT [POLICY]``
(any number of processes): ``load_state()`` with the default ``per_rank`` (or
``enable(accelerator, per_rank=POLICY)``) and records what happened: the step restored, the
warnings of the world-size change, the state compared bit for bit with rank 0's save, or the
error. Each rank writes ``OUT/<mode>-rank<r>.json`` (``tests.checks.Checks``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from tests.checks import Checks, state_of
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska

MODE, OUT = sys.argv[1], sys.argv[2]
POLICY = sys.argv[3] if len(sys.argv) > 3 else None
checks = Checks()


def setup(acc: Accelerator, seed: int) -> Any:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(123)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    dl = DataLoader(ds, batch_size=4, shuffle=True)
    return acc.prepare(model, opt, dl)


def snapshot(model: Any, opt: Any) -> dict[str, Any]:
    return state_of(getattr(model, "module", model), getattr(opt, "optimizer", opt))


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    proj = os.path.join(OUT, "proj")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=proj, automatic_checkpoint_naming=True))
    if MODE == "save":
        ska.enable(acc, async_save=False)
        model, opt, dl = setup(acc, seed=0)
        for trained, (x, y) in enumerate(dl, start=1):
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
            if trained == 3:
                break
        acc.save_state(step=3)
        torch.save(snapshot(model, opt), os.path.join(OUT, f"saved-{rank}.pt"))
        checks.check("saved", True)
    else:
        ska.enable(acc, async_save=False, **({"per_rank": POLICY} if POLICY else {}))
        model, opt, dl = setup(acc, seed=99)  # other seeds: the restore must matter
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored: int | None = None
            error: str | None = None
            try:
                restored = acc.load_state()
            except Exception as e:  # recorded for the test to read
                error = f"{type(e).__name__}: {e}"
        said = [str(w.message) for w in caught if "world size" in str(w.message)]
        checks.check("restored_step", restored == 3, f"{restored} {error}")
        checks.same("params_and_optimizer_bit_exact", snapshot(model, opt), torch.load(os.path.join(OUT, "saved-0.pt")))
        with open(os.path.join(OUT, f"said-{world}-{POLICY}-rank{rank}.json"), "w") as f:
            json.dump({"said": said, "error": error}, f)
    checks.write(os.path.join(OUT, f"{MODE}-rank{rank}.json"))
    acc.end_training()


if __name__ == "__main__":
    main()
