"""The real Trainer killed with a save in flight, then resumed: one process and DDP (torchrun,
2 gloo ranks). The torn step is never resumed from; the resume lands mid-epoch on the newest
committed step, and every later loss and the final parameters and AdamW state equal an
uninterrupted run's bit for bit (tests/transformers/dist/trainer_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

pytest.importorskip("shardkeeper.transformers")

WORKER = Path(__file__).parent / "dist" / "trainer_worker.py"
RESUME_CHECKS = [
    "crashed_step_not_committed",
    "resumed_at_committed_step",
    "next_losses_bit_exact",
    "final_params_and_optimizer_bit_exact",
    "saves_after_resume_committed",
]


def _kill_and_resume(nproc: int, out: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1"}
    ref = run_script(nproc, WORKER, "reference", str(out), timeout_s=150, env=env)
    assert ref.returncode == 0, ref.stdout[-4000:]
    crash = run_script(nproc, WORKER, "crash", str(out), timeout_s=150, env=env)
    assert crash.returncode != 0, "the crash run was meant to kill itself:\n" + crash.stdout[-4000:]
    assert not (out / "crash-rank0.json").exists(), "the crash run got past its kill"
    killed = sorted(p.name for p in out.glob("killed-rank*"))
    assert killed == [f"killed-rank{r}" for r in range(nproc)], (
        f"not killed at its save: {killed}\n{crash.stdout[-4000:]}"
    )
    resume = run_script(nproc, WORKER, "resume", str(out), timeout_s=150, env=env)
    assert resume.returncode == 0, resume.stdout[-4000:]
    checks = read_checks(*(out / f"resume-rank{r}.json" for r in range(nproc)), output=resume.stdout)
    assert_checks(checks, RESUME_CHECKS, where=f"{nproc} process(es)")


@pytest.mark.timeout(480)
def test_single_process_kill_during_save_then_resume_is_bit_exact(tmp_path: Path) -> None:
    _kill_and_resume(1, tmp_path)


@pytest.mark.timeout(600)
def test_ddp_kill_during_save_then_resume_is_bit_exact(tmp_path: Path) -> None:
    _kill_and_resume(2, tmp_path)
