"""An Accelerate loop interrupted mid-epoch at one world size and resumed at another (torchrun).

    data_worker.py first OUT KIND   # any world size: save_state() after step 3, train on to step 5, stop
    data_worker.py second OUT KIND  # any world size: load_state(), finish the epoch, train the next

``KIND``: ``shuffle``, a plain ``DataLoader(shuffle=True)`` (Accelerate gives its sampler a
synchronized generator); ``own``, a sampler of the user's own (a seeded permutation per epoch,
``set_epoch``); ``seedable``, ``shuffle=True`` with ``use_seedable_sampler=True``. The dataset returns each sample's index; every rank records, per pass over the
DataLoader, the indices of each batch (``OUT/<phase>-ids-r<rank>.json``: ``[[pass, step,
[ids]], ...]``). ``first`` writes the parameters and optimizer state after step 3 to
``OUT/saved-r<rank>.pt``; ``second`` compares them bit for bit with what it restored
(``OUT/second-r<rank>.json``, ``tests.checks.Checks``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from tests.checks import Checks, state_of
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import shardkeeper.accelerate as ska

N, BATCH, SAVED_STEP = 48, 4, 3


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class EpochPermutation(Sampler[int]):
    """A user's sampler: ``randperm(N)`` seeded with ``seed + epoch``."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(N, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


def main() -> None:
    phase, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    checks = Checks()
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=os.path.join(out, "proj"), automatic_checkpoint_naming=True),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=kind == "seedable", data_seed=3),
    )
    ska.enable(acc, async_save=False)
    torch.manual_seed(0 if phase == "first" else 99)  # other seeds: the restore must matter
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "own":
        dl = DataLoader(Indexed(), batch_size=BATCH, sampler=EpochPermutation(seed=5))
    else:
        dl = DataLoader(Indexed(), batch_size=BATCH, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    seen: list[list[Any]] = []
    passes = 1
    if phase == "second":
        checks.check("restored the saved step", acc.load_state() == SAVED_STEP)
        checks.same(
            "parameters and optimizer state restored bit for bit",
            state_of(getattr(model, "module", model), getattr(opt, "optimizer", opt)),
            torch.load(os.path.join(out, "saved-r0.pt")),
        )
        passes = 2  # the rest of the saved epoch, then the next one
    step = 0
    for p in range(passes):
        for x, y, idx in dl:
            step += 1
            seen.append([p, step, [int(i) for i in idx]])
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
            if phase == "first" and step == SAVED_STEP:
                acc.save_state(step=SAVED_STEP)
                torch.save(
                    state_of(getattr(model, "module", model), getattr(opt, "optimizer", opt)),
                    os.path.join(out, f"saved-r{rank}.pt"),
                )
            if phase == "first" and step == 5:
                break  # steps 4 and 5: work lost with the run
    with open(os.path.join(out, f"{phase}-ids-r{rank}.json"), "w") as f:
        json.dump(seen, f)
    checks.write(os.path.join(out, f"{phase}-r{rank}.json"))
    acc.end_training()


if __name__ == "__main__":
    main()
