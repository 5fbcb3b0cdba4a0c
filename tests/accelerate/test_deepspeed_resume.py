"""The real Accelerator with DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks (CPU), through the DeepSpeed adapter.

Two torchrun launches (tests/accelerate/dist/ds_worker.py): save (reference run + interrupted run
with total_limit=2), then resume in a new process: fp32 masters and Adam moments bit for bit
(DeepSpeed's own ``safe_get_full_*``), counters, registered object, scheduler, DataLoader
position, next losses and final state bit for bit, retention across the restart. A stage DeepSpeed itself cannot train on the installed torch
(DeepSpeed < 0.19 only: its reference run fails before any checkpoint) is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed integration imports it

pytestmark = [pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "dist" / "ds_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
SAVE_CHECKS = {
    "distributed_type",
    "world_size_2",
    "interrupted_run_matches_reference_so_far",
    "retention_total_limit_2",
    "canonical_keys",
    "global_shapes",
}
RESUME_CHECKS = {
    "distributed_type",
    "restored_newest_step",
    "iteration_counter_restored",
    "engine_global_steps_restored",
    "fp32_masters_and_moments_bit_exact_after_load",
    "module_params_equal_masters",
    "registered_object_restored",
    "scheduler_restored",
    "dataloader_epoch_restored",
    "plain_torch_restores_deepspeed_checkpoint",
    "dataloader_resumes_at_right_batch",
    "next_losses_bit_exact",
    "final_state_bit_exact",
    "registered_object_final",
    "retention_across_restart",
}


def _launch(mode: str, out: Path, stage: int, expected: set[str]) -> None:
    proc = run_script(2, WORKER, mode, str(out), str(stage), timeout_s=150, env=ENV)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = read_checks(*(out / f"ds{stage}-{mode}-rank{rank}.json" for rank in range(2)), output=proc.stdout)
    assert_checks(checks, sorted(expected), where=f"ZeRO-{stage} {mode}")  # skips if DeepSpeed cannot train


@pytest.mark.timeout(360)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_save_resume_in_new_process(tmp_path: Path, stage: int) -> None:
    _launch("save", tmp_path, stage, SAVE_CHECKS)
    _launch("resume", tmp_path, stage, RESUME_CHECKS)
