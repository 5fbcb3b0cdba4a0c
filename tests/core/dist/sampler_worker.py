"""An epoch interrupted at one world size and finished at another (tests/core/data/test_resumable_sampler.py).

    sampler_worker.py first|second ROOT OUT

``first`` (2 ranks): a DDP model trains 3 steps on batches of 4 from a ``DataLoader`` with 2
workers over a ``ResumableDistributedSampler`` of 60 samples (epoch 1), reporting each batch
with ``advance``, then saves model, optimizer and sampler at step 3. ``second`` (3 ranks):
restores them and trains to the end of the epoch. Each rank writes ``OUT/r<rank>.json``: the
sample ids it trained on, the position at its end, and (``second``) whether the next epoch's
indices are DistributedSampler's at world size 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
from seen import finish  # noqa: E402

from shardkeeper.core import CheckpointManager, ResumableDistributedSampler  # noqa: E402

N, BATCH, STEPS, SEED, EPOCH = 60, 4, 3, 11, 1


def main(phase: str, root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.arange(N)
    sampler = ResumableDistributedSampler(data, seed=SEED)  # world size and rank from the group
    state = {"model": model, "optim": opt, "sampler": sampler}
    if phase == "second":
        with CheckpointManager(root) as mgr:
            assert mgr.restore(state) == STEPS
        assert sampler.epoch == EPOCH and sampler.consumed == 2 * STEPS * BATCH
    sampler.set_epoch(EPOCH)
    ids: list[int] = []
    for i, batch in enumerate(DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)):
        if phase == "first" and i == STEPS:
            break
        loss = model(batch.float().unsqueeze(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(len(batch))
        ids += batch.tolist()
    seen: dict[str, object] = {"ids": ids, "consumed": sampler.consumed}
    if phase == "first":
        with CheckpointManager(root) as mgr:
            mgr.save(STEPS, state).wait()
    else:
        ref = DistributedSampler(data, seed=SEED)
        ref.set_epoch(EPOCH + 1)
        sampler.set_epoch(EPOCH + 1)
        seen["next_epoch_ok"] = list(sampler) == list(ref)
    finish(out, rank, seen)


if __name__ == "__main__":
    main(*sys.argv[1:4])
