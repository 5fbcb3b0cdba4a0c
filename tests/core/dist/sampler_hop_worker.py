"""One hop of an epoch that changes world size at every resume (tests/core/data/test_sampler_hops.py).

    sampler_hop_worker.py ROOT OUT HOP STOP MODE

Each rank restores the newest committed step under ``ROOT`` (none: a fresh start), then a DDP
model trains on batches of 2 from a ``DataLoader`` (1 worker) over a
``ResumableDistributedSampler`` of 64 samples (epoch 3), reporting each batch with
``advance``. Every step's sample ids go to ``OUT/hop<HOP>-r<rank>.jsonl`` as soon as the step
is trained (a line ``{"step", "ids"}``); rank 0 writes the restored step to
``OUT/hop<HOP>-restored``. MODE:

- ``kill``: saves and commits every step up to ``STOP``, trains one step more without saving,
  writes ``OUT/hop<HOP>-ready-r<rank>`` and waits for the test's SIGKILL;
- ``inflight``: the same, but the step after ``STOP`` is saved too, and its commit (the
  manifest put on rank 0) is held back: the SIGKILL lands with that save in flight;
- ``finish``: trains to the end of the epoch, commits its last step, and records in
  ``OUT/r<rank>.json`` whether the next epoch's indices are DistributedSampler's at this size.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardkeeper.core import CheckpointManager, ResumableDistributedSampler
from shardkeeper.core.storage import LocalStorage
from tests.core.dist.seen import finish

N, BATCH, SEED, EPOCH = 64, 2, 5, 3


class Ids(Dataset[int]):
    """Sample ``i`` is ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class HeldCommit(LocalStorage):
    """Holds back the manifest of step ``held``: its save stays in flight."""

    def __init__(self, root: str, held: int) -> None:
        super().__init__(root)
        self.held = held

    def put_if_absent(self, path: str, data: bytes) -> None:
        if path.endswith("manifest.json") and f"step-{self.held:012d}" in path:
            time.sleep(600)
        super().put_if_absent(path, data)


def main(root: str, out: str, hop: str, stop_text: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = int(stop_text)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Ids()
    sampler = ResumableDistributedSampler(data, seed=SEED)  # world size and rank from the group
    state = {"model": model, "optim": opt, "sampler": sampler}
    mgr = CheckpointManager(HeldCommit(root, stop + 1) if mode == "inflight" else LocalStorage(root))
    step = mgr.restore(state) if mgr.latest_step() is not None else 0
    if rank == 0:
        Path(out, f"hop{hop}-restored").write_text(str(step))
    sampler.set_epoch(EPOCH)  # the restored epoch stays where it stands
    log = open(os.path.join(out, f"hop{hop}-r{rank}.jsonl"), "a")  # noqa: SIM115 - open until the kill
    for batch in DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=1):
        loss = model(batch.float().unsqueeze(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(len(batch))
        step += 1
        log.write(json.dumps({"step": step, "ids": batch.tolist()}) + "\n")
        log.flush()  # in the kernel's hands: a SIGKILL keeps it
        if mode == "finish" or step <= stop:
            if mode != "finish" or sampler.consumed == N:
                mgr.save(step, state).wait()
            continue
        if mode == "inflight":
            mgr.save(step, state)  # returns once staged; rank 0's commit is held back
        Path(out, f"hop{hop}-ready-r{rank}").touch()
        time.sleep(600)  # the test kills the launch
    seen: dict[str, object] = {"consumed": sampler.consumed, "steps": step}
    ref: DistributedSampler[int] = DistributedSampler(data, seed=SEED)
    ref.set_epoch(EPOCH + 1)
    sampler.set_epoch(EPOCH + 1)
    seen["next_epoch_ok"] = list(sampler) == list(ref)
    mgr.close()
    finish(out, rank, seen)


if __name__ == "__main__":
    main(*sys.argv[1:6])
