"""The real Trainer on 2 gloo processes: ddp, ModelParallel FSDP2 (dp=2) and TP (tp=2),
FSDPStrategy (FSDP1, sharded, a CPU-wrapping subclass) and DeepSpeedStrategy(stage=2 and 3) (a
CPU-allowing subclass; the engine's state through the DeepSpeed adapter).

Three launches: ``train`` (uninterrupted runs, every save through the plugin, strategies'
own writers spied on), ``resume`` (new processes resume from ModelCheckpoint's and
save_checkpoint's paths and must match the uninterrupted runs bit for bit), ``cross`` (one
process: the FSDP2 checkpoint under ddp at world size 1; a core-written checkpoint; a
Lightning .ckpt and a Lightning sharded directory (stock ModelParallel, saved at the end of
``train``) imported; the FSDP2 checkpoint in plain torch and in a DeepSpeed engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script
from tests.persist_probe import assert_persist_processes_gone

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "worker.py"


def _run(nproc: int, phase: str, d: Path, env: dict[str, str] | None = None) -> list[dict]:
    proc = run_script(nproc, WORKER, phase, str(d), timeout_s=240, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    checks = read_checks(d / f"{phase}.json", output=proc.stdout)
    assert checks, proc.stdout[-3000:]
    return checks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    d = tmp_path_factory.mktemp("lightning-runs")
    out = {"train": _run(2, "train", d)}
    out["resume"] = _run(2, "resume", d)
    out["cross"] = _run(1, "cross", d)
    return out


@pytest.mark.timeout(600)
def test_uninterrupted_runs_save_only_through_the_plugin(runs: dict[str, list[dict]]) -> None:
    assert_checks(runs["train"])
    assert len(runs["train"]) == 26


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "tp", "fsdp1", "ds2", "ds3"])
def test_resume_matches_uninterrupted_run_bit_for_bit(runs: dict[str, list[dict]], strategy: str) -> None:
    mine = [c for c in runs["resume"] if c["name"].startswith(f"{strategy} ") or "raised" in c["name"]]
    assert len(mine) == 12, runs["resume"]
    assert_checks(mine)


@pytest.mark.timeout(600)
def test_ddp_resume_bit_for_bit_with_the_process_writer(tmp_path: Path) -> None:
    """The ddp launches again with ``writer="process"``: every save is written and committed by
    persist processes, both resumes match the uninterrupted run bit for bit, and no persist
    process outlives its trainer."""
    env = {"SK_STRATEGIES": "ddp", "SK_WRITER": "process", "SHARDKEEPER_PERSIST_LOCKS": str(tmp_path / "locks")}
    train = _run(2, "train", tmp_path, env)
    assert_checks(train)
    assert len(train) == 6, train  # 4 of ddp, its persist processes, no torch.save or DCP save
    resume = _run(2, "resume", tmp_path, env)
    assert_checks(resume)
    assert len(resume) == 15, resume  # 12 of ddp, its persist processes from 2 checkpoints, no torch.save
    assert_persist_processes_gone(*(tmp_path / f"persist-pids-r{r}" for r in range(2)))


def _cross(runs: dict[str, list[dict]], *words: str) -> list[dict]:
    return [c for c in runs["cross"] if any(w in c["name"] for w in words)]


@pytest.mark.timeout(600)
def test_resume_at_another_world_size_and_from_a_core_checkpoint(runs: dict[str, list[dict]]) -> None:
    mine = _cross(runs, "fsdp2 dp=2", "fsdp2 -> ddp", "core-written", "raised")
    assert len(mine) == 3, runs["cross"]
    assert_checks(mine)


@pytest.mark.timeout(600)
def test_imported_lightning_ckpt_resumes_like_the_ckpt(runs: dict[str, list[dict]]) -> None:
    mine = [c for c in _cross(runs, "import", "raised") if "sharded" not in c["name"]]
    assert len(mine) == 7, runs["cross"]
    assert_checks(mine)


@pytest.mark.timeout(600)
def test_imported_sharded_directory_matches_and_resumes(runs: dict[str, list[dict]]) -> None:
    """Lightning's own ModelParallel sharded directory (DCP + meta.pt, written by the train
    launch) imported in one process: state bit for bit, canonical keys, a Trainer resumes."""
    mine = _cross(runs, "sharded import", "raised") + [c for c in runs["train"] if "sharded directory" in c["name"]]
    assert len(mine) == 7, runs["cross"]
    assert_checks(mine)


@pytest.mark.timeout(600)
def test_plugin_fsdp2_checkpoint_restores_in_plain_torch_and_deepspeed(runs: dict[str, list[dict]]) -> None:
    mine = _cross(runs, "-> plain torch", "-> DeepSpeed", "raised")
    assert len(mine) == 2, runs["cross"]
    assert_checks(mine)
