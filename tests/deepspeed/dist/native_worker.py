"""One process (a world of one on gloo/CPU): a ZeRO-2 engine trains two steps and writes a
native DeepSpeed checkpoint with ``engine.save_checkpoint`` (no shardkeeper involved).

    native_worker.py OUT     writes OUT/native/{latest, global_step2/...}
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

import deepspeed
import torch

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

STEPS = 2


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
    engine.save_checkpoint(os.path.join(out, "native"), tag=f"global_step{STEPS}")
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
