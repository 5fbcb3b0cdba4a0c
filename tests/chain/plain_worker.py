"""Hop 6: plain torch in one process: ``CheckpointManager(root).restore`` the newest step into a
plain module and ``torch.optim.Adam``.

    plain_worker.py ROOT OUT
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402
from tests.chain.common import Hop, Net, adam, record, run_hop  # noqa: E402


def run(hop: Hop, root: str) -> None:
    torch.manual_seed(100 + hop.index)
    model = Net()
    opt = adam(model.parameters())
    with CheckpointManager(root) as mgr:
        newest = mgr.latest_step()
        step = mgr.restore({"model": model, "optim": opt}, only=["model/*", "optim/*"])
    params = dict(model.named_parameters())
    hop.loaded(step, record(params, {n: opt.state.get(p, {}) for n, p in params.items()}))
    hop.counter("the step restore() returns (the loop's counter)", step, newest)


if __name__ == "__main__":
    run_hop("plain", run)
