"""The crash trial (shardkeeper.core.testing.crash_trial): a trainer SIGKILLed right after
``save()`` returns, then a fresh trainer restores. With ``writer="process"`` the save commits
and restores bit for bit, no persist process and no lock file is left; with the thread writer
the trial shows the save lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardkeeper.core.testing.crash_trial import run_crash_trials, to_markdown


def _clean(js: dict[str, object]) -> str:
    return json.dumps({k: v for k, v in js.items() if k != "per_trial"}, indent=1)


@pytest.mark.timeout(600)
def test_a_trainer_killed_after_save_returned_loses_nothing_at_two_ranks(tmp_path: Path) -> None:
    """Each rank's trainer in turn is the victim, right after the save of step 2 returned;
    torchrun tears the other down. The fresh launch restores step 2 bit for bit on both ranks."""
    s = run_crash_trials(tmp_path, ranks=2, trials=2, seed=3, steps=(2,), tensor_bytes=256 << 10)
    js = s.to_json()
    assert js["failures"] == [] and js["committed_restored"] == 2, _clean(js)
    assert sorted(r.victim for r in s.results) == [0, 1]
    assert all(r.latest == [2, 2] and len(r.persist_pids) == 2 for r in s.results), js["per_trial"]
    assert js["persist_processes_left"] == 0 and js["lock_files_left"] == 0, _clean(js)
    assert "| 2 | process | every rank's save() | 2 | 2/2 | 2: 2/2 |" in to_markdown([s])
    assert not any(tmp_path.glob("*/trial-*")), "a passing trial's folder was kept"


@pytest.mark.timeout(300)
def test_the_thread_writer_loses_the_save_its_trainer_dies_after(tmp_path: Path) -> None:
    """The contrast, and the proof that the trial sees a loss: with ``writer="thread"`` the
    save dies with its trainer, counted as lost (not as a failure of the trial)."""
    s = run_crash_trials(tmp_path, ranks=1, trials=1, seed=0, steps=(2,), writer="thread", tensor_bytes=4 << 20)
    js = s.to_json()
    assert js["committed_restored"] == 0 and js["lost"] == 1 and js["failures"] == [], _clean(js)
    assert s.results[0].latest[0] in (None, 1) and s.results[0].persist_pids == [], js["per_trial"]


@pytest.mark.timeout(300)
def test_a_trainer_killed_right_after_its_first_save_loses_nothing(tmp_path: Path) -> None:
    """The save that started the persist process commits too, its trainer killed right after."""
    s = run_crash_trials(tmp_path, ranks=1, trials=1, seed=0, steps=(1,), tensor_bytes=256 << 10)
    js = s.to_json()
    assert js["failures"] == [] and js["committed_restored"] == 1, _clean(js)


def test_what_a_trial_cannot_run_with_is_refused_before_any_launch(tmp_path: Path) -> None:
    for argv, said in (
        (["--ranks", "0"], "ranks must be at least 1"),
        (["--ranks", "two"], "comma-separated integers"),
        (["--steps", "0,1"], "steps one or more steps from 1"),
        (["--writer", "fork"], "invalid choice"),
    ):
        cmd = [sys.executable, "-m", "shardkeeper.core.testing.crash_trial", str(tmp_path / "w"), *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and said in out.stderr and not out.stdout, (argv, out)
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="writer='fork'"):
        run_crash_trials(tmp_path / "w", writer="fork")
