"""A user's DeepSpeed script (a world of one on gloo/CPU) that saves through the attached hook
and ends without hook.wait() or detach().

    exit_script.py ROOT WIDTH      # writes ROOT.ref.safetensors: the module as saved
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

import deepspeed
import torch
from safetensors.torch import save_file

import shardkeeper.deepspeed as skds

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> None:
    root, width = sys.argv[1], int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    skds.attach(engine, root)
    x, y = torch.randn(4, width), torch.randn(4, 3)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
    # the reference first: anything slow after the save would give it time to finish before the exit
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, root + ".ref.safetensors")
    engine.save_checkpoint(root, tag="global_step1")
    print('RESULT {"saved": true}', flush=True)


if __name__ == "__main__":
    main()
