"""The real Accelerator on 2 gloo ranks (MULTI_CPU): save, resume in a new process, compare.

Two torchrun launches carry every multi-process check (tests/accelerate/dist/ddp_worker.py):
bit-exact resume against an uninterrupted run, DataLoader position, registered objects,
retention across a restart, plain-torch and core-written cross restores, several models, and
the FSDP2 (``fully_shard``) path. One more single-process launch (dist/cross_worker.py)
restores the DDP checkpoint in a Lightning Trainer and into a DeepSpeed ZeRO-2 engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script
from tests.persist_probe import assert_persist_processes_gone, persist_check

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "ddp_worker.py"
SAVE_CHECKS = {"distributed_type", "interrupted_run_matches_reference_so_far", "retention_total_limit_2"}
RESUME_CHECKS = {
    "distributed_type",
    "restored_newest_step",
    "iteration_counter_restored",
    "params_and_optimizer_bit_exact_after_load",
    "registered_object_restored",
    "scheduler_restored",
    "dataloader_epoch_restored",
    "plain_torch_restores_accelerate_checkpoint",
    "dataloader_resumes_at_right_batch",
    "next_losses_bit_exact",
    "final_params_and_optimizer_bit_exact",
    "registered_object_final",
    "retention_across_restart",
    "retention_removed_folders",
    "step_folder_input_dir",
    "core_written_checkpoint_restores",
    "several_models_roundtrip",
    "fsdp2_params_bit_exact_after_load",
    "fsdp2_next_losses_bit_exact",
    "fsdp2_saved_global_shapes",
}


def _launch(mode: str, out: Path, expected: set[str], env: dict[str, str] | None = None) -> None:
    proc = run_script(2, WORKER, mode, str(out), timeout_s=150, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = read_checks(*(out / f"{mode}-rank{rank}.json" for rank in range(2)), output=proc.stdout)
    assert_checks(checks, sorted(expected), where=mode)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both DDP launches; their checks are asserted by the test below, the folder reused."""
    out = tmp_path_factory.mktemp("ddp")
    _launch("save", out, SAVE_CHECKS)
    _launch("resume", out, RESUME_CHECKS)
    return out


@pytest.mark.timeout(360)
def test_ddp_save_resume_in_new_process(ddp_run: Path) -> None:
    assert (ddp_run / "cross-0.pt").exists()


@pytest.mark.timeout(360)
def test_ddp_save_resume_with_the_process_writer(tmp_path: Path) -> None:
    """Both launches again with ``SHARDKEEPER_WRITER=process`` (read by ``enable()``): every
    save (async, sync, other roots, FSDP2) is written and committed by persist processes, the
    same checks hold, and no persist process outlives its trainer."""
    env = {"SHARDKEEPER_WRITER": "process", "SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    _launch("save", tmp_path, SAVE_CHECKS | {persist_check("save")}, env)
    _launch("resume", tmp_path, RESUME_CHECKS | {persist_check("resume")}, env)
    assert_persist_processes_gone(*(tmp_path / f"persist-pids-{rank}" for rank in range(2)))


@pytest.mark.timeout(420)
def test_ddp_checkpoint_restores_in_lightning_and_deepspeed(ddp_run: Path) -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("shardkeeper.lightning")
    proc = run_script(
        1,
        Path(__file__).parent / "dist" / "cross_worker.py",
        str(ddp_run),
        timeout_s=120,
        env={"DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = read_checks(ddp_run / "cross.json", output=proc.stdout)
    names = [
        "lightning_restores_ddp_checkpoint",
        "lightning_continues_the_step_count",
        "deepspeed_engine_restores_ddp_checkpoint",
    ]
    assert_checks(checks, names)
    assert len(checks) == len(names), [c["name"] for c in checks]
