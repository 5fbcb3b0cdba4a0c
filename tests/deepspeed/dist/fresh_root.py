"""A DeepSpeed script (a world of one on gloo/CPU) run three times on one attached root: the
first run saves, a fresh one is refused at its first backward (before any training step), a
resumed one trains and saves on; then a fresh run on a root holding only a torn step trains.

    fresh_root.py ROOT      # prints RESULT {...}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import warnings
from pathlib import Path

import deepspeed
import torch

import shardkeeper.deepspeed as skds
from shardkeeper.core import CheckpointManager, StartRefusedError

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


def make_engine() -> object:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_step(engine: object) -> None:
    x, y = torch.ones(4, 8), torch.zeros(4, 3)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def main() -> None:
    root = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, object] = {}

    first = make_engine()
    hook = skds.attach(first, root, async_save=False)
    for _ in range(2):
        train_step(first)
    first.save_checkpoint(root)  # step 2
    hook.detach()

    fresh = make_engine()  # the same script again, without load_checkpoint
    hook = skds.attach(fresh, root)
    before = {k: v.detach().clone() for k, v in fresh.module.state_dict().items()}
    try:
        train_step(fresh)
        out["refused"] = None
    except StartRefusedError as e:
        out["refused"] = str(e)
    out["untouched"] = all(torch.equal(before[k], v) for k, v in fresh.module.state_dict().items())
    out["fresh_steps"] = int(fresh.global_steps)
    hook.detach()

    resumed = make_engine()
    hook = skds.attach(resumed, root, async_save=False)
    resumed.load_checkpoint(root)
    train_step(resumed)
    resumed.save_checkpoint(root)  # step 3
    hook.detach()
    with CheckpointManager(root) as mgr:
        out["steps"] = mgr.steps()

    torn = Path(root + "-torn")
    (torn / "step-000000000002" / "data").mkdir(parents=True)  # a crash's leftovers: no manifest
    again = make_engine()
    hook = skds.attach(again, str(torn))
    train_step(again)
    out["torn_trains"] = int(again.global_steps)
    hook.detach()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
