"""The real Trainer killed with a save in flight, then resumed: one process, DDP, DeepSpeed
ZeRO-3 and FSDP2 sharded at load time (torchrun, 2 gloo ranks). The torn step is never resumed
from and has no ``checkpoint-N`` folder: ``get_last_checkpoint`` names the newest committed
step, and the resume from that folder lands mid-epoch on it; every later loss and the final
parameters and AdamW state equal an uninterrupted run's bit for bit
(tests/transformers/dist/trainer_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script
from tests.persist_probe import assert_persist_processes_gone, persist_check

pytest.importorskip("shardkeeper.transformers")

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "trainer_worker.py"
ENV = {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
RESUME_CHECKS = [
    "crashed_step_not_committed",
    "newest_folder_is_the_newest_committed_step",
    "resumed_at_committed_step",
    "next_losses_bit_exact",
    "final_params_and_optimizer_bit_exact",
    "saves_after_resume_committed",
    "folders_are_the_committed_steps",
]
#: With ``writer="process"`` the killed trainers' persist processes commit the step in flight,
#: and the resume starts there (``resume_from_checkpoint=True``).
PROCESS_RESUME_CHECKS = [
    "crashed_step_committed_by_persist_processes",
    persist_check("resume"),
    *RESUME_CHECKS[2:],
]


def _kill_and_resume(nproc: int, out: Path, *, layout: str = "", writer: str = "thread") -> None:
    """A launch of ``nproc`` ranks that runs the reference, then the crash (``layout``:
    trainer_worker.py's); then the resume, in a new launch. ``writer="process"``: the crash
    run's persist processes commit the step in flight after its trainers died."""
    env = {**ENV, "SK_WRITER": writer, "SHARDKEEPER_PERSIST_LOCKS": str(out / "locks")}
    more = (layout,) if layout else ()
    crash = run_script(nproc, WORKER, "reference+crash", str(out), *more, timeout_s=240, env=env)
    assert crash.returncode != 0, "the crash run was meant to kill itself:\n" + crash.stdout[-4000:]
    ran = sorted(p.name for p in out.glob("reference-rank*.pt"))
    assert ran == [f"reference-rank{r}.pt" for r in range(nproc)], (
        f"the reference did not end: {ran}\n{crash.stdout[-4000:]}"
    )
    assert not (out / "crash-rank0.json").exists(), "the crash run got past its kill"
    killed = sorted(p.name for p in out.glob("killed-rank*"))
    assert killed == [f"killed-rank{r}" for r in range(nproc)], (
        f"not killed at its save: {killed}\n{crash.stdout[-4000:]}"
    )
    if writer == "process":  # the launch ended with its persist processes (they hold its output)
        committed = (out / "run" / "step-000000000008" / "manifest.json").exists()
        assert committed and not (out / "run" / "checkpoint-8").exists(), (
            f"step 8 was not committed by the persist processes alone: {sorted(p.name for p in (out / 'run').iterdir())}"
        )
    resume = run_script(nproc, WORKER, "resume", str(out), *more, timeout_s=150, env=env)
    assert resume.returncode == 0, resume.stdout[-4000:]
    checks = read_checks(*(out / f"resume-rank{r}.json" for r in range(nproc)), output=resume.stdout)
    expected = PROCESS_RESUME_CHECKS if writer == "process" else RESUME_CHECKS
    assert_checks(checks, expected, where=f"{nproc} process(es), writer={writer}")
    if writer == "process":
        assert_persist_processes_gone(*(out / f"persist-pids-r{r}" for r in range(nproc)))


@pytest.mark.timeout(480)
def test_single_process_kill_during_save_then_resume_is_bit_exact(tmp_path: Path) -> None:
    _kill_and_resume(1, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_ddp_kill_during_save_then_resume_is_bit_exact(tmp_path: Path, writer: str) -> None:
    """thread: the step in flight is never committed and the resume takes the one before;
    process: the persist processes commit it after the trainers died, and the resume takes it."""
    _kill_and_resume(2, tmp_path, writer=writer)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["zero3", "fsdp2", "plugin-fsdp2", "plugin-fsdp1"])
def test_sharded_kill_then_resume_is_bit_exact_and_other_layouts_resume_it(layout: str, tmp_path: Path) -> None:
    """A sharded Trainer (2 ranks): DeepSpeed ZeRO-3 with the Trainer's AdamW; FSDP2 applied by
    transformers at load time (``DistributedConfig``), which the Trainer alone cannot
    checkpoint; or Accelerate's FSDP plugin, FSDP2 (DTensors) or FSDP1 (a wrapping root). Killed with a save in flight and resumed bit for bit (the losses, the full
    parameters and Adam moments); then a one-process Trainer (and, from ZeRO-3, an FSDP2 one)
    resumes its step 12 holding that state bit for bit, and trains on."""
    if layout.startswith("zero"):
        pytest.importorskip("deepspeed")
        pytest.importorskip("shardkeeper.deepspeed")
    _kill_and_resume(2, tmp_path, layout=layout)
    # another world size and layout: one process; and a ZeRO-3 step (which holds the tied
    # lm_head.weight under one name) in a 2-rank FSDP2 Trainer
    for nproc, other in [(1, "")] + ([(2, "fsdp2")] if layout == "zero3" else []):
        more = (other,) if other else ()
        cross = run_script(nproc, WORKER, "cross", str(tmp_path), *more, timeout_s=150, env=ENV)
        assert cross.returncode == 0, cross.stdout[-4000:]
        checks = read_checks(*(tmp_path / f"cross-rank{r}.json" for r in range(nproc)), output=cross.stdout)
        names = ["resumed_at_the_step_and_trained_on", "sharded_checkpoint_restores_in_another_layout"]
        assert_checks(checks, names, where=f"{layout} -> {other or 'one process'}")
