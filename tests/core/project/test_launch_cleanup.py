"""The test launcher's timeout: hung torchrun workers print their stacks and are all killed.

torchrun starts each worker in a session of its own; a launcher that kills only its process
group leaves hung ranks running and blocks on their open output pipe (seen in CI).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .._launch import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_timeout_dumps_every_rank_stack_and_kills_the_tree(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as info:
        run_workers(2, "hang_worker.py", str(tmp_path), timeout_s=15)
    message = str(info.value)
    assert "timed out after 15" in message
    assert message.count("stuck_in_a_collective_forever") >= 2, message[-3000:]
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], f"workers still running: {pids}"
