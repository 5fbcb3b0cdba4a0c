"""The checkpoint-interval advisor: the formulas on known values, the timings every commit
records in the manifest, and ``shardkeeper advise`` on a real root."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.storage import open_storage
from shardkeeper.core.tools.advisor import (
    SaveSample,
    advise,
    daly_interval,
    expected_lost_work,
    mtbf_from_restarts,
    parse_duration,
    young_interval,
)


def test_young_and_daly_on_known_values() -> None:
    # C = 1 min, M = 3 h: sqrt(2 * 60 * 10800) = 1138.42 s; Daly's correction lowers it to 1098.77 s
    assert young_interval(60, 10800) == pytest.approx(1138.4199576606165, rel=1e-12)
    assert daly_interval(60, 10800) == pytest.approx(1098.7713218450797, rel=1e-12)
    assert young_interval(5, 3600) == pytest.approx(189.73665961010275, rel=1e-12)
    assert daly_interval(5, 3600) == pytest.approx(186.41796645112206, rel=1e-12)
    assert daly_interval(100, 40) == 40  # C >= 2M: checkpoint once per MTBF
    assert young_interval(0, 3600) == 0
    with pytest.raises(ValueError, match="MTBF"):
        young_interval(1, 0)


def test_expected_lost_work_and_mtbf_from_restarts() -> None:
    assert expected_lost_work(600, cost_s=2, durable_s=30, sync=False) == 330  # T/2 + W
    assert expected_lost_work(600, cost_s=30, durable_s=30, sync=True, restart_s=60) == 375  # (T+C)/2 + R
    assert mtbf_from_restarts(4, parse_duration("2d")) == 43200
    with pytest.raises(ValueError, match="lower bound"):
        mtbf_from_restarts(0, 3600)


def test_parse_duration() -> None:
    assert parse_duration("3h") == 10800 and parse_duration("30m") == 1800 and parse_duration("90s") == 90
    assert parse_duration("1d12h") == 129600 and parse_duration("250ms") == 0.25 and parse_duration("42") == 42
    with pytest.raises(ValueError, match="3h"):
        parse_duration("soon")


def _samples(stall: float, save: float, sync: bool = False) -> list[SaveSample]:
    return [SaveSample(s, stall, save * 0.9, save * 0.1, save, sync) for s in (10, 20, 30)]


def test_advice_warns_when_the_write_outlasts_the_interval() -> None:
    a = advise(_samples(0.5, 2.0), mtbf_s=3600)
    assert a.cost_s == 0.5 and a.durable_s == 2.0 and not a.warnings
    assert a.recommended_s == pytest.approx(daly_interval(0.5, 3600))
    assert a.lost_work_s == pytest.approx(a.recommended_s / 2 + 2.0)
    # the write takes 5 min, the Daly interval for C = 0.5 s, M = 1 h is ~60 s
    slow = advise(_samples(0.5, 300.0), mtbf_s=3600, interval_s=120)
    assert slow.recommended_s == 300.0
    assert any("longer than the optimal interval" in w for w in slow.warnings)
    assert any("does not finish before the next save" in w for w in slow.warnings)
    sync = advise(_samples(0.5, 2.0, sync=True), mtbf_s=3600)
    assert sync.sync and sync.cost_s == 2.5  # a synchronous save blocks for all of it


def test_commits_record_timings_and_advise_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.randn(256, 256)}).wait()
        mgr.save(3, {"w": torch.randn(256, 256)}, async_save=False)
    storage = open_storage(str(root))
    t = [load_manifest(storage, s).metadata["timings"] for s in (1, 2, 3)]
    assert [x["sync"] for x in t] == [False, False, True]
    for x in t:
        assert x["stall_s"] > 0 and x["write_s"] > 0 and x["commit_s"] >= 0
        assert x["save_s"] >= x["write_s"]  # one rank: its write plus the commit
    assert main(["advise", str(root), "--mtbf", "3h", "--interval", "30m", "--last", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == 2 and out["sync"] is True  # the newest save was synchronous
    cost = (max(t[1]["stall_s"], t[2]["stall_s"]) + min(t[1]["stall_s"], t[2]["stall_s"])) / 2 + (
        (t[1]["save_s"] + t[2]["save_s"]) / 2
    )
    assert out["cost_s"] == pytest.approx(cost)
    assert out["young_s"] == pytest.approx(math.sqrt(2 * cost * 10800))
    assert out["interval_s"] == 1800
    assert main(["advise", str(root), "--restarts", "3", "--elapsed", "9h"]) == 0
    text = capsys.readouterr().out
    assert "MTBF 3.00 h" in text and "recommended: save every" in text


def test_advise_without_recorded_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.joinpath("empty").mkdir()
    assert main(["advise", str(tmp_path / "empty"), "--mtbf", "3h"]) == 2
    assert "no save timings recorded" in capsys.readouterr().err
    assert main(["advise", str(tmp_path / "empty")]) == 2
    assert "--mtbf" in capsys.readouterr().err
    assert main(["advise", str(tmp_path / "empty"), "--mtbf", "3h", "--cost", "1m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["young_s"] == pytest.approx(1138.4199576606165)
