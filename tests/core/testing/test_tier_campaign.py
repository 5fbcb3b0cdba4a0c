"""The kill -9 campaign on the erasure-coded node tier (shardkeeper.core.testing.tier_campaign):
four simulated nodes, one process each, erasure=(3, 1); a node's process killed mid-save,
its directory deleted at times, and the next launch's restore checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkeeper.core.testing.campaign import main
from shardkeeper.core.testing.tier_campaign import run_tier_campaign


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_short_campaign_on_four_nodes_loses_nothing(tmp_path: Path) -> None:
    """Every restore is the newest committed step, bit for bit, from the local tier with no
    byte read from the persistent root, also right after a node lost its directory (some of
    those restores rebuild the lost node's files from parity) or after a restore was killed;
    gc and a save leave nothing of the uncommitted saves on the nodes."""
    summary = run_tier_campaign(
        tmp_path / "root", tmp_path / "local", nodes=4, erasure=(3, 1), trials=6, seed=3, lose_probability=1.0,
        points=("random_time", "close", "restore", "mid_write", "before_manifest", "retention"),
        tensor_bytes=64 << 10,
    )  # fmt: skip
    js = summary.to_json()
    assert js["failures"] == [] and js["writer_errors"] == [], json.dumps(js, indent=1)
    assert js["trials"] == 6 and js["killed"] >= 3 and js["commits_acknowledged"] > 0, js
    assert js["nodes_replaced"] >= 1 and js["rebuilt_from_parity"] >= 1, js
    assert js["restores_by_tier"].get("local", 0) >= 3 and js["restores_bit_exact"] >= 3, js


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_campaign_command_takes_erasure_and_refuses_what_it_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = str(tmp_path / "l")
    for argv, said in (
        (["--erasure", "3,1"], "--erasure needs --local"),
        (["--local", local, "--erasure", "3"], "--erasure takes K,M"),
        (["--local", local, "--erasure", "3,1", "--nodes", "3"], "nodes >= k + m"),
        (["--local", local, "--erasure", "3,1", "--manager-options", '{"replicas": 1}'], "never replicas"),
    ):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "root"), *argv])
        out = capsys.readouterr()
        assert e.value.code == 2 and said in out.err and not out.out, (argv, out.err[-2000:])
    assert not (tmp_path / "l").exists()
    argv = ["--local", local, "--erasure", "2,1", "--nodes", "3", "--trials", "1", "--tensor-bytes", "4096"]
    assert main([str(tmp_path / "root"), *argv]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["trials"] == 1 and js["erasure"] == [2, 1] and js["nodes"] == 3 and js["failures"] == [], js
