"""Where a DeepSpeed user sets ``per_rank``: a DeepSpeed engine (a world of one on gloo/CPU)
attached to a root; a bad ``per_rank`` given to ``attach()`` and one given to a restore of its
manager both name ``attach(engine, per_rank=...)``.

    per_rank_call.py ROOT      # prints RESULT {...}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import warnings

import deepspeed
import torch

import shardkeeper.deepspeed as skds
from shardkeeper.core import PerRank

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


def error_of(fn) -> str | None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    root = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    out: dict[str, object] = {}
    out["attach"] = error_of(lambda: skds.attach(engine, root, per_rank="nope").managers.get(root))
    hook = skds.attach(engine, root, async_save=False)
    mgr = hook.managers.get(root)
    mgr.save(1, {"own": PerRank(torch.ones(2))})
    out["restore"] = error_of(lambda: mgr.restore({"own": PerRank(torch.zeros(2))}, per_rank="nope"))
    hook.detach()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
