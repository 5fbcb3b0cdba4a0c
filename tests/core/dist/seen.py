"""The end of a worker that records what each rank saw: ``OUT_DIR/r<rank>.json``, written
before the last barrier, so that the test reads every rank's file once the launch ends."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist


def finish(out: str, rank: int, seen: dict[str, Any]) -> None:
    """Write ``seen`` for ``rank``, wait for every rank, and leave the process group."""
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()
