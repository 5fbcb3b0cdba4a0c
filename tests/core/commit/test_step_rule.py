"""The core manager's step rule: a save below the root's newest committed step is refused.

The newest committed step is what a resume goes back to, so a lower save would commit and then
be silently skipped by the next resume (the state trained last lost). ``save()`` refuses it on
the caller's thread before a byte is written, as it refuses a committed step, and its advice
is advice that works (the newest step is never deleted, so it never says to delete it). The
root is listed once per manager; a stale view never refuses a legal save.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardkeeper.core.adapter.steps as adapter_steps
import shardkeeper.core.commit.committed as commit_mod
from shardkeeper.core import CheckpointManager, CommitConflictError, StepOrderError
from shardkeeper.core.adapter import check_save_step
from shardkeeper.core.format.layout import step_dir
from tests.core._launch import run_workers


def _state(v: float) -> dict[str, object]:
    return {"w": torch.full((16,), v), "step": int(v)}


def _saved(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_a_save_below_the_newest_step_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root) as mgr:
        mgr.save(5, _state(5), async_save=False)
        mgr.save(10, _state(10))  # in flight: the next save waits for it, so step 10 counts
        with pytest.raises(StepOrderError) as e:
            mgr.save(7, _state(7))
        msg = str(e.value)
        assert msg.startswith(f"step 7 is below the newest committed step 10 under {mgr.storage.url} (rank 0)"), msg
        assert "wrote nothing" in msg and "restore()" in msg and "above 10" in msg and "another root" in msg, msg
        assert isinstance(e.value, CommitConflictError) and (e.value.step, e.value.newest) == (7, 10)
        assert _saved(root) == [step_dir(5), step_dir(10)]  # no step directory for 7
        assert mgr.steps() == [5, 10]
        mgr.save(11, _state(11), async_save=False)  # the manager goes on above the newest
        assert mgr.steps() == [5, 10, 11]


def test_a_fresh_manager_and_a_resume_from_an_older_step_are_refused_too(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root) as mgr:
        mgr.save(5, _state(5), async_save=False)
        mgr.save(10, _state(10), async_save=False)
    with CheckpointManager(root) as mgr:  # a resume from step 5, then training on
        got = _state(0)
        assert mgr.restore(got, step=5) == 5
        with pytest.raises(StepOrderError, match="step 6 is below the newest committed step 10"):
            mgr.save(6, got)
        assert mgr.steps() == [5, 10] and mgr.latest_step() == 10
        restored = _state(0)
        assert mgr.restore(restored) == 10 and torch.equal(restored["w"], torch.full((16,), 10.0))


def test_a_committed_step_below_the_newest_is_named_both_ways(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(5, _state(5), async_save=False)
        mgr.save(10, _state(10), async_save=False)
        with pytest.raises(StepOrderError) as e:
            mgr.save(5, _state(0))
        msg = str(e.value)
        assert "step 5 is already committed under" in msg and "below the newest committed step 10" in msg, msg
        assert "delete" not in msg and "above 10" in msg, msg
        got = _state(0)
        assert mgr.restore(got, step=5) == 5 and torch.equal(got["w"], torch.full((16,), 5.0))  # untouched


def test_saving_the_newest_step_again_gives_advice_that_works(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(10, _state(10), async_save=False)
        with pytest.raises(CommitConflictError) as e:
            mgr.save(10, _state(0))
        msg = str(e.value)
        assert not isinstance(e.value, StepOrderError)
        assert "step 10 is already committed under" in msg and "newest committed step" in msg, msg
        assert "mgr.delete(" not in msg and "is never deleted" in msg and "--damaged" in msg, msg
        assert "above 10" in msg and "another root" in msg, msg
        assert mgr.delete(10) is False and mgr.steps() == [10]  # what the advice says, indeed
        mgr.save(11, _state(11), async_save=False)
        assert mgr.steps() == [10, 11]


def test_the_root_is_listed_once_per_manager_and_adapters_add_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = commit_mod.manifest_steps

    def counting(storage: object) -> list[int]:
        calls.append(1)
        return real(storage)  # type: ignore[arg-type]

    monkeypatch.setattr(commit_mod, "manifest_steps", counting)  # newest_committed's listing
    monkeypatch.setattr(adapter_steps, "manifest_steps", counting)
    with CheckpointManager(tmp_path / "r") as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), async_save=False)
        assert len(calls) == 1, f"{len(calls)} listings of the root for 5 saves"
        calls.clear()
        for step in range(6, 9):  # an adapter's save: its own rule, then the core's
            check_save_step(mgr, step).raise_if_refused("Fw")
            mgr.save(step, _state(step), async_save=False)
        assert len(calls) == 3, f"{len(calls)} listings for 3 adapter saves: the core listed again"


def test_a_stale_view_never_refuses_a_legal_save(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root) as mgr:
        mgr.save(5, _state(5), async_save=False)
        mgr.save(10, _state(10), async_save=False)
        shutil.rmtree(root / step_dir(10))  # removed by hand: 5 is the newest again
        mgr.save(7, _state(7), async_save=False)
        assert mgr.steps() == [5, 7]
        with pytest.raises(StepOrderError, match="step 6 is below the newest committed step 7"):
            mgr.save(6, _state(6))


def test_another_managers_commit_counts_when_the_view_is_refreshed(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root) as a, CheckpointManager(root) as b:
        a.save(5, _state(5), async_save=False)
        b.save(20, _state(20), async_save=False)  # b's first save lists the root: 5 is there
        with pytest.raises(StepOrderError, match="step 6 is below the newest committed step 20"):
            b.save(6, _state(6))
        with pytest.raises(StepOrderError, match="step 4 is below the newest committed step 20"):
            a.save(4, _state(4))  # a's view says 5, the refusal's fresh listing says 20
        assert a.steps() == [5, 20]


def test_retention_and_delete_keep_the_rule_sound(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root, keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), async_save=False)
        assert mgr.steps() == [4, 5]
        assert mgr.delete(4) is True and mgr.steps() == [5]
        with pytest.raises(StepOrderError, match="step 4 is below the newest committed step 5"):
            mgr.save(4, _state(4))  # deleted, yet still below the newest
        mgr.save(6, _state(6), async_save=False)
        assert mgr.steps() == [5, 6]


@pytest.mark.multiprocess
def test_every_rank_refuses_a_save_below_the_newest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    res = run_workers(2, "step_rule_worker.py", str(tmp_path / "r"), str(out), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    for rank in (0, 1):
        seen = json.loads((out / f"r{rank}.json").read_text())
        for step in (7, 5):
            got = seen[str(step)]
            assert got is not None, f"rank {rank}: save({step}) below the newest step 10 was not refused"
            assert (got["step"], got["newest"]) == (step, 10) and f"rank {rank}" in got["message"], got
        assert seen["steps"] == [5, 10, 11]
        # Ranks that ask for different steps: every rank refuses, reading nothing (rank 0's
        # step used to be restored everywhere, silently).
        for name in ("5 vs 10", "newest vs 10"):
            got = seen[f"restore {name}"]
            assert got is not None, f"rank {rank}: a restore of {name} went through"
            assert got["untouched"] and f"rank {rank} asked for" in got["message"], got
            assert "same step=" in got["message"], got
        assert seen["restore 10 everywhere"] is True
