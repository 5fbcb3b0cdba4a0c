"""The erasure-coded node tier across four simulated nodes: four torchrun agents
(``--nnodes=4``, one rank each), a local directory per node, the persistent root on a
loopback S3 server. With ``erasure=(3, 1)`` nodes 0-2 form one group (its parity on node 3).
One launch sequence: node 1 is killed (SIGKILL) with a save in flight and its directory
deleted, and the newest step committed locally is rebuilt from parity and restores bit for
bit with no read from S3; then nodes 0 and 1 are both lost, more than the group's parity
covers, and the restore falls back to the persisted step, saying so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.checks import assert_checks, read_checks
from tests.core.tiers.test_tiers import _agents, _logs, _run_until

NODES = 4


def _resume(tmp: Path, name: str, cfg: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Restore the newest step on the four nodes; each rank's report and the agents' logs."""
    out = tmp / name
    out.mkdir()
    _run_until(_agents(list(range(NODES)), "resume", out, cfg, per_node=1), out, None, 90)
    assert_checks(read_checks(*(out / f"checks-r{r}.json" for r in range(NODES)), output=_logs(out)))
    return [json.loads((out / f"resume-r{r}.json").read_text()) for r in range(NODES)], _logs(out)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_lost_node_is_rebuilt_from_parity_and_two_fall_back_to_s3(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    url, options = s3_root
    cfg = {
        "root": url,
        "storage_options": options,
        "locals": [str(tmp_path / f"node{n}") for n in range(NODES)],
        "commit_timeout_s": 20,
        "steps": 3,
        "persist_every": 100,  # step 1 only
        "erasure": [3, 1],
        "expect_persisted": [1],
        "kill_node": 1,
    }
    out = tmp_path / "save"
    out.mkdir()
    _run_until(
        _agents(list(range(NODES)), "save", out, cfg, per_node=1),
        out,
        lambda: len(list(out.glob("[kw]*-r*"))) == NODES,
        90,
    )
    assert_checks(read_checks(*(out / f"save-r{r}.json" for r in range(NODES)), output=_logs(out)))
    assert (out / "killed-r1").exists()
    assert not any(tmp_path.glob("node*/step-000000000004/manifest.json"))  # the save in flight
    parity = tmp_path / "node3" / ".parity" / "step-000000000003"
    assert sorted(p.name for p in parity.iterdir()) == ["g0-p0", "g0-p0.json"]  # group [0, 1, 2]'s

    # the second scenario starts from this state (a restore makes every node's copy whole):
    # nodes 0 and 1 lost, two of the group, more than its one parity shard covers
    two = [str(tmp_path / "two-lost" / f"node{n}") for n in range(NODES)]
    for node in (2, 3):
        shutil.copytree(tmp_path / f"node{node}", two[node])

    shutil.rmtree(tmp_path / "node1")  # the node is replaced by an empty one
    got, logs = _resume(tmp_path, "one-lost", cfg)
    assert [g["step"] for g in got] == [3] * NODES, got
    assert [g["tier"] for g in got] == ["local"] * NODES, got
    assert [g["persistent_reads"] for g in got] == [0] * NODES, got
    assert any((tmp_path / "node1" / "step-000000000003" / "data").glob("r00001-*")), logs  # its own files again
    assert "step 3: the files of node(s) 1 rebuilt here from parity" in logs, logs

    got, logs = _resume(tmp_path, "two-lost-run", {**cfg, "locals": two})
    assert [g["step"] for g in got] == [1] * NODES, got
    assert [g["tier"] for g in got] == ["persistent"] * NODES, got
    assert all(g["persistent_reads"] > 0 for g in got), got
    # by name: the steps no node holds whole, and the persistent root restored from instead
    for node in (2, 3):
        assert f"removing local step 3 of {two[node]}: no tier holds it whole (restored step 1)" in logs, logs
    assert f"{url}: this job (writer" in logs and "takes over 2 step claim(s) above the step it restored" in logs, logs
    assert "whole on no node this job sees (a job that lost its nodes)" in logs, logs
