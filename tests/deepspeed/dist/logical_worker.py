"""One model saved under ZeRO-1, -2 and -3 (tests/deepspeed/test_logical_matrix.py).

    logical_worker.py ROOT

At 2 ranks, for each stage: a DeepSpeed fp32 engine of ``Net`` (seed 0, Adam) is saved at step
0, as built, and at step 1, after one training step on the same batches, under ``ROOT/z<stage>``
(``shardkeeper.deepspeed.engine_state``). The test compares the manifests' logical digests.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import deepspeed  # noqa: E402  (after torch, as DeepSpeed expects)
import torch
import torch.distributed as dist

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from tests.deepspeed.logical_net import Net  # noqa: E402

import shardkeeper.deepspeed as skds  # noqa: E402
from shardkeeper.core import CheckpointManager  # noqa: E402


def main(root: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        with CheckpointManager(root / f"z{stage}") as mgr:
            mgr.save(0, skds.engine_state(engine), async_save=False)
            g = torch.Generator().manual_seed(100 + rank)
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
            engine.backward(((engine(x) - y) ** 2).mean())
            engine.step()
            mgr.save(1, skds.engine_state(engine), async_save=False)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
