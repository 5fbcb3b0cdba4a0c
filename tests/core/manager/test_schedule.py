"""``mgr.should_save(step)``: every N steps, every T seconds, or the advisor's Young/Daly
interval from the root's recorded save timings; the same answer on every rank (2 gloo ranks
whose clocks differ); the options' checks and their settings from text."""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CheckpointOptions, IneffectiveOptionWarning
from shardkeeper.core.config.settings import options_from_env, options_from_file
from shardkeeper.core.manager.schedule import RecordedTimings, SaveSchedule
from shardkeeper.core.storage import open_storage
from shardkeeper.core.tools.advisor import advise, recent_samples
from tests.core._launch import run_workers


class Clock:
    """A clock a test moves: ``now`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Agreed:
    """One process's ``agree``: the value itself (world size 1), counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, value: int) -> int:
        self.calls += 1
        return value


def _run(schedule: SaveSchedule, clock: Clock, steps: range, seconds_per_step: float) -> list[int]:
    """Call ``should_save`` at each step, the clock moving ``seconds_per_step`` before each;
    the steps it said to save at (each then marked saved, as ``mgr.save`` does)."""
    saved = []
    for step in steps:
        clock.now += seconds_per_step
        if schedule.should_save(step):
            saved.append(step)
            schedule.mark(step)
    return saved


# -- every N steps -----------------------------------------------------------------------------


def test_every_n_steps_saves_at_the_multiples_and_never_at_or_below_a_saved_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", save_every_steps=5, async_save=False) as mgr:
        said = [s for s in range(0, 23) if mgr.should_save(s)]
        assert said == [0, 5, 10, 15, 20]
        mgr.save(10, {"w": torch.zeros(3)})
        assert not mgr.should_save(10) and not mgr.should_save(5)  # a save there would be refused
        assert mgr.should_save(15) and mgr.should_save(30)
        assert mgr.should_save(40) is True and isinstance(mgr.should_save(41), bool)
    with CheckpointManager(tmp_path / "run", save_every_steps=5) as mgr:
        assert mgr.restore({"w": torch.ones(3)}) == 10
        assert [s for s in range(0, 21) if mgr.should_save(s)] == [15, 20]  # none at or below the restored step


# -- every T seconds -----------------------------------------------------------------------------


def test_every_t_seconds_saves_once_per_interval_with_a_few_checks() -> None:
    clock, agreed = Clock(), Agreed()
    schedule = SaveSchedule(CheckpointOptions(save_every_s=60.0), rank=0, agree=agreed, clock=clock)
    saved = _run(schedule, clock, range(1, 1001), 0.5)  # 500 s of 0.5 s steps
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert saved[0] == 121 and gaps == [120] * (len(saved) - 1), saved  # 60 s from the first call, then every 60 s
    assert len(saved) == 8
    # checks: log2(120) + a few per interval, not one per step
    assert agreed.calls <= len(saved) * (math.log2(120) + 3), agreed.calls


def test_every_t_seconds_follows_a_change_of_pace() -> None:
    clock = Clock()
    schedule = SaveSchedule(CheckpointOptions(save_every_s=10.0), rank=0, agree=Agreed(), clock=clock)
    saved = _run(schedule, clock, range(0, 200), 0.1)  # 20 s at 0.1 s a step: saves at 10 s, 20 s
    times = []
    for step in range(200, 400):  # then 4x slower: still about every 10 s of the clock
        clock.now += 0.4
        if schedule.should_save(step):
            times.append(clock.now)
            schedule.mark(step)
    assert saved == [100], saved  # 10 s after the first call (at 0.1 s)
    assert times[0] == pytest.approx(20.4)  # the first step past 20 s of the clock
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) >= 5 and all(abs(g - 10) <= 0.4 + 1e-9 for g in gaps), (times, gaps)  # within a step


def test_every_t_seconds_on_the_real_clock(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_every_s=0.2) as mgr:
        t0 = time.monotonic()
        said = []
        for step in range(120):
            time.sleep(0.01)
            if mgr.should_save(step):
                said.append(time.monotonic() - t0)
                mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()
        elapsed = time.monotonic() - t0
    assert said[0] >= 0.15, said  # (a save comes up to half a step early: nearer than the next step)
    gaps = [b - a for a, b in zip(said, said[1:])]
    assert all(g >= 0.12 for g in gaps), gaps
    assert int(elapsed / 0.2) - 2 <= len(said) <= int(elapsed / 0.2) + 1, (said, elapsed)


# -- the advised interval -----------------------------------------------------------------------


def test_the_advised_interval_comes_from_the_timings_recorded_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        for step in range(3):
            mgr.save(step, {"w": torch.randn(64, 64)}).wait()
    storage = open_storage(str(root))
    want = advise(recent_samples(storage), mtbf_s=600.0).recommended_s
    clock = Clock()
    schedule = SaveSchedule(
        CheckpointOptions(save_every_s="advised", mtbf_s=600.0),
        rank=0,
        agree=Agreed(),
        timings=RecordedTimings(lambda: storage),
        clock=clock,
    )
    schedule.mark(2)  # restored
    per_step = want / 50  # the advised interval is 50 steps at this pace
    saved = _run(schedule, clock, range(3, 300), per_step)
    assert saved[:3] == [53, 103, 153], (saved, want)


def test_the_advised_interval_on_a_new_root_saves_first_to_measure(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", save_every_s="advised", mtbf_s=3600.0) as mgr:
        assert mgr.should_save(0)  # no timings recorded: this save measures the cost
        mgr.save(0, {"w": torch.randn(256, 256)}).wait()
        said = [s for s in range(1, 50) if mgr.should_save(s)]
        assert said == [], said  # then the interval is sqrt(2 C M)-ish: far more than 49 fast steps
        advised = advise(recent_samples(mgr.storage), mtbf_s=3600.0).recommended_s
        assert advised > 0.1


# -- bad input ----------------------------------------------------------------------------------


def test_should_save_without_a_schedule_or_with_a_bad_step_says_what_to_pass(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(
            ValueError, match="no save schedule.*save_every_steps=N.*save_every_s='advised' with mtbf_s"
        ):
            mgr.should_save(3)
    with CheckpointManager(tmp_path, save_every_steps=2) as mgr:
        with pytest.raises(TypeError, match=r"should_save\(\): step must be an int >= 0.*mgr.should_save\(step\)"):
            mgr.should_save("3")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step must be >= 0"):
            mgr.should_save(-1)


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"save_every_steps": 0}, ValueError, r"save_every_steps=0; pass an int >= 1"),
        ({"save_every_steps": 2.5}, TypeError, r"save_every_steps=2.5 is of type float; save_every_steps takes an int"),
        ({"save_every_s": 0}, ValueError, r"save_every_s=0.0; save_every_s takes seconds > 0"),
        ({"save_every_s": float("inf")}, ValueError, r"save_every_s=inf; save_every_s takes seconds > 0 \(a finite"),
        ({"save_every_s": "adviced"}, ValueError, r"save_every_s='adviced'; choose a number or 'advised' or None"),
        ({"save_every_s": "advised"}, ValueError, r"'advised' without mtbf_s.*pass mtbf_s"),
        ({"save_every_s": "advised", "mtbf_s": -1}, ValueError, r"mtbf_s=-1.0; mtbf_s takes the job's mean time"),
        (
            {"save_every_steps": 10, "save_every_s": 60},
            ValueError,
            r"save_every_steps=10 and save_every_s=60.0.*pass one",
        ),
        ({"keep_best": 3}, TypeError, r"keep_best=3 is not a triple; pass keep_best=\(n, metric, mode\)"),
        ({"keep_best": (0, "loss", "min")}, ValueError, r"keep_best=\(0, 'loss', 'min'\): n must be >= 1"),
        ({"keep_best": (2, "", "min")}, TypeError, r"metric must be the name of a metadata key"),
        ({"keep_best": (2, "loss", "lower")}, ValueError, r"mode must be 'min' \(lower is better\) or 'max'"),
        ({"keep_best": (True, "loss", "min")}, TypeError, r"n must be an int >= 1, not bool"),
    ],
)
def test_bad_schedule_and_keep_best_options_name_the_option_and_the_remedy(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        CheckpointOptions(**options)
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path / "never", **options)
    assert not (tmp_path / "never").exists()  # refused before the root is touched


def test_mtbf_without_the_advised_interval_warns_and_a_list_is_a_triple() -> None:
    with pytest.warns(IneffectiveOptionWarning, match="mtbf_s=3600.0 without save_every_s='advised'"):
        CheckpointOptions(mtbf_s=3600, save_every_steps=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = CheckpointOptions(save_every_s="advised", mtbf_s=3600, keep_best=[3, "val_loss", "max"])  # type: ignore[arg-type]
    assert o.keep_best == (3, "val_loss", "max") and o.save_every_s == "advised"


def test_the_options_come_from_the_environment_and_files(tmp_path: Path) -> None:
    env = {
        "SHARDKEEPER_SAVE_EVERY_S": "advised",
        "SHARDKEEPER_MTBF_S": "21600",
        "SHARDKEEPER_KEEP_BEST": "3, val_loss, min",
    }
    got = options_from_env(env)
    assert got == {"save_every_s": "advised", "mtbf_s": 21600.0, "keep_best": (3, "val_loss", "min")}
    assert CheckpointOptions(**got).keep_best == (3, "val_loss", "min")
    assert options_from_env({"SHARDKEEPER_SAVE_EVERY_S": "600", "SHARDKEEPER_KEEP_BEST": '[2, "acc", "max"]'}) == {
        "save_every_s": 600.0,
        "keep_best": (2, "acc", "max"),
    }
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"save_every_steps": 500, "keep_best": [1, "loss", "min"]}))
    assert options_from_file(path) == {"save_every_steps": 500, "keep_best": (1, "loss", "min")}
    with pytest.raises(
        ValueError, match=r"'keep_best' from \$SHARDKEEPER_KEEP_BEST is '3,val_loss'.*expected 3 values"
    ):
        options_from_env({"SHARDKEEPER_KEEP_BEST": "3,val_loss"})


# -- every rank agrees ----------------------------------------------------------------------------


def test_two_ranks_with_different_clocks_agree_on_every_answer(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1's clock skewed (offset, 7x its rate) and its steps slower: both
    get the same answers at every step, every save they make together commits, and the
    saves follow rank 0's clock (dist/schedule_worker.py)."""
    out = tmp_path / "out"
    out.mkdir()
    res = run_workers(2, "schedule_worker.py", str(tmp_path / "run"), str(out), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    seen = [json.loads((out / f"r{r}.json").read_text()) for r in range(2)]
    for name in ("seconds", "advised"):
        r0, r1 = seen[0][name], seen[1][name]
        assert r0["said"] == r1["said"], (name, r0["said"], r1["said"])
        assert r0["said"], name
        assert r0["steps"] == r1["steps"] == r0["said"], (name, r0, r1)  # every save committed
        assert r0["checks"] == r1["checks"] <= 0.6 * r0["calls"], (name, r0["checks"], r0["calls"])  # not every step
    seconds = seen[0]["seconds"]
    # rank 0's clock: one save per 0.5 s of its time (rank 1's would make about 7x as many), or
    # fewer where the synchronous saves themselves are slow (a loaded machine): the pace each
    # check measures then includes the save, and the next check comes later
    due = seconds["elapsed"] / 0.5
    assert max(2.0, due / 2) <= len(seconds["said"]) <= due + 2, seconds
