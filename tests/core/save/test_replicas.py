"""Replica agreement at save (save/replicas.py): the copies of a replicated tensor that are
not written are compared with the written one through their logical sums. At 2 ranks
(``dist/replica_worker.py``): a copy one ulp off is refused on both ranks, naming the tensor,
the step and the ranks on each side (the previous step stays the newest), for plain tensors
(DDP) and a replicated DTensor, also when recorded by its rule (described layouts: the
writers named from the rule); ``logical_check="warn"`` commits with the mark, for both, and a restore of that step warns;
``"off"`` compares nothing; a DDP model's BatchNorm buffers, which differ by rank after a forward,
are not compared, its parameters are. At 4 ranks (``dist/submesh_replica_worker.py``): the
copies of a DTensor on a submesh, which its mesh does not name, are compared too."""

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
        assert "rank(s) [0] wrote" in err, (r, err)
        assert "model/b" not in err, (r, err)  # the copies that agree are not named
        assert got["error"]["latest"] == 1, (r, got)
        dt = got["dtensor"]["error"]
        assert "tensor 'norm'" in dt and "tensor 'model/w'" in dt and got["dtensor"]["latest"] == 1, (r, dt)
        described = got["described"]["error"]  # the copies' sums survive the described report's split
        assert "tensor 'norm'" in described and "tensor 'model/w'" in described, (r, described)
        norm = "tensor 'norm': the copy on rank(s) [1] differs from the one rank(s) [0] wrote"
        assert norm in described and "written copy" not in described, (r, described)  # its rule's writers
        assert got["described"]["latest"] == 1, (r, got)
        assert got["warn"]["error"] == "" and got["warn"]["latest"] == 2, (r, got)
        assert "tensor 'model/w'" in got["warn"]["mark"], (r, got)
        back = got["warn"]["restore"]  # a fresh manager's restore of the marked step warns on each rank
        assert back["step"] == 2 and back["written"] and back["stats_mark"] == got["warn"]["mark"], (r, back)
        (said,) = back["warnings"]
        assert "step 2 under" in said and str(tmp_path / "roots" / "warn") in said, (r, said)
        assert got["warn"]["mark"] in said and "rank(s) [0] wrote" in said and "shardkeeper verify" in said, (r, said)
        dw = got["described_warn"]
        assert dw["error"] == "" and dw["latest"] == 2 and norm in dw["mark"], (r, dw)
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


def test_copies_of_a_submesh_dtensor_are_compared(tmp_path: Path) -> None:
    """4 ranks, a 2x2 ("dp", "tp") mesh and DTensors row-sharded on ``mesh["dp"]``
    (``dist/submesh_replica_worker.py``): the TP copies, which the DTensor's mesh does not
    name, are compared as a ``Replicate`` dimension's are, chunks listed or described."""
    res = run_workers(4, "submesh_replica_worker.py", str(tmp_path / "roots"), str(tmp_path), timeout_s=300)
    assert res.returncode == 0, res.stdout[-6000:]
    for r in range(4):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["partials"]["combined"] == got["partials"]["digest"], (r, got["partials"])  # each copy once
        for name in ("listed", "described", "warn"):
            run = got[name]
            assert run["clean"] and run["restored"] == 1 and run["exact"], (r, name, run)  # equal copies
        for name in ("listed", "described"):
            err = got[name]["error"]  # refused on every rank, naming the tensor, the step and both sides
            assert "StateMismatchError" in err and "step 2" in err and "tensor 'fsdp/w'" in err, (r, name, err)
            assert "copy on rank(s) [0, 2]" in err or "copy on rank(s) [1, 3]" in err, (r, name, err)
            assert "fsdp/b" not in err and got[name]["latest"] == 1, (r, name, got[name])
            # the ranks on each side (a described leaf's writers: its rule's copy)
            assert "rank(s) [0, 2]" in err and "rank(s) [1, 3]" in err and "written copy" not in err, (r, name, err)
            assert "one rank(s) [0, 2] wrote" in err or "one rank(s) [1, 3] wrote" in err, (r, name, err)
        warn = got["warn"]
        assert warn["error"] == "" and warn["latest"] == 2 and "tensor 'fsdp/w'" in warn["mark"], (r, warn)
        assert "rank(s) [0, 2]" in warn["mark"] and "rank(s) [1, 3]" in warn["mark"], (r, warn)
