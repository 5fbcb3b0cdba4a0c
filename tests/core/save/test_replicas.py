"""Replica agreement at save (save/replicas.py): the copies of a replicated tensor that are
not written are compared with the written one through their logical sums. At 2 ranks
(``dist/replica_worker.py``): a copy one ulp off is refused on both ranks, naming the tensor,
the step and the ranks on each side (the previous step stays the newest), for plain tensors
(DDP) and a replicated DTensor, also when recorded by its rule (described layouts); ``logical_check="warn"`` commits with the mark; ``"off"``
compares nothing; a DDP model's BatchNorm buffers, which differ by rank after a forward,
are not compared, its parameters are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .._launch import run_workers

pytestmark = pytest.mark.multiprocess


def test_copies_that_disagree_are_refused_named_or_marked(tmp_path: Path) -> None:
    res = run_workers(2, "replica_worker.py", str(tmp_path / "roots"), str(tmp_path), timeout_s=240)
    assert res.returncode == 0, res.stdout[-6000:]
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        err = got["error"]["error"]
        assert "step 2" in err and "tensor 'model/w'" in err and "rank(s) [1]" in err, (r, err)
        assert "rank(s) [0] wrote" in err or "written copy" in err, (r, err)
        assert "model/b" not in err, (r, err)  # the copies that agree are not named
        assert got["error"]["latest"] == 1, (r, got)
        dt = got["dtensor"]["error"]
        assert "tensor 'norm'" in dt and "tensor 'model/w'" in dt and got["dtensor"]["latest"] == 1, (r, dt)
        described = got["described"]["error"]  # the copies' sums survive the described report's split
        assert "tensor 'norm'" in described and "tensor 'model/w'" in described, (r, described)
        assert got["described"]["latest"] == 1, (r, got)
        assert got["warn"]["error"] == "" and got["warn"]["latest"] == 2, (r, got)
        assert "tensor 'model/w'" in got["warn"]["mark"], (r, got)
        assert got["off"]["latest"] == 1, (r, got)
        bn = got["ddp_bn"]  # buffers (BatchNorm's running statistics) differ by rank: not compared
        assert bn["state_dict_latest"] == 1, (r, bn)  # its statistics as a state dict's plain tensors too
        assert bn["latest"] == 1 and "tensor 'model/0.weight'" in bn["error"] and "running" not in bn["error"], (r, bn)
    verified = subprocess.run(
        [sys.executable, "-m", "shardkeeper.core.cli", "verify", str(tmp_path / "roots" / "warn"), "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr  # readable: a warning, not damage
    warned = json.loads(verified.stdout)["steps"][0]
    assert warned["problems"] == [], warned
    (w,) = warned["warnings"]
    assert w["kind"] == "replicas" and "tensor 'model/w'" in w["message"], w
