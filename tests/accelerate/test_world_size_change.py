"""A real Accelerator saved on 2 gloo ranks (torchrun) resumes on 1 and 1 -> 2.

By default the resume goes ahead with one warning (rank 0) that names the per-rank state
(``rng``, ``data``), how it was mapped, both world sizes and the step; the model and the
optimizer come back bit for bit. ``enable(accelerator, per_rank="exact")`` refuses with an
error naming the step, both world sizes and ``enable(accelerator, per_rank=...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

pytestmark = [pytest.mark.multiprocess]  # launches processes: run one after another (noxfile)

WORKER = Path(__file__).parent / "dist" / "world_worker.py"


def _run(nproc: int, out: Path, *args: str) -> str:
    proc = run_script(nproc, WORKER, *args, str(out), timeout_s=150, torchrun=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _said(out: Path, world: int, policy: str | None, rank: int) -> dict[str, Any]:
    return cast("dict[str, Any]", json.loads((out / f"said-{world}-{policy}-rank{rank}.json").read_text()))


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world2")
    _run(2, out, "save")
    return out


@pytest.mark.timeout(300)
def test_saved_on_two_resumes_on_one_by_default_with_one_warning(saved_on_two: Path) -> None:
    stdout = run_script(1, WORKER, "resume", str(saved_on_two), timeout_s=150, torchrun=True).stdout
    checks = read_checks(saved_on_two / "resume-rank0.json", output=stdout)
    assert_checks(checks, ["restored_step", "params_and_optimizer_bit_exact"], where="2 -> 1")
    said = _said(saved_on_two, 1, None, 0)
    assert said["error"] is None
    assert len(said["said"]) == 1, said
    msg = said["said"][0]
    for part in ("step 3", "world size 2", "1", "'rng'", "'data'", "rank 0", "rank 1", "per_rank"):
        assert part in msg, (part, msg)
    assert "enable(accelerator, per_rank=" in msg, msg


@pytest.mark.timeout(300)
def test_exact_refuses_naming_the_step_world_sizes_and_the_enable_call(saved_on_two: Path) -> None:
    stdout = run_script(1, WORKER, "resume", str(saved_on_two), "exact", timeout_s=150, torchrun=True).stdout
    said = _said(saved_on_two, 1, "exact", 0)
    assert said["error"] is not None, stdout[-3000:]
    err = said["error"]
    assert err.startswith("StateMismatchError"), err
    for part in ("step 3", "world size 2", "restoring at 1", "enable(accelerator, per_rank=...)", "'map'"):
        assert part in err, (part, err)


@pytest.mark.timeout(300)
def test_saved_on_one_resumes_on_two_by_default(tmp_path: Path) -> None:
    _run(1, tmp_path, "save")
    stdout = _run(2, tmp_path, "resume")
    checks = read_checks(*(tmp_path / f"resume-rank{r}.json" for r in range(2)), output=stdout)
    assert_checks(checks, ["restored_step", "params_and_optimizer_bit_exact"], where="1 -> 2")
    said0, said1 = _said(tmp_path, 2, None, 0), _said(tmp_path, 2, None, 1)
    assert len(said0["said"]) == 1 and not said1["said"], (said0, said1)  # one warning, on rank 0
    assert "rank 1" in said0["said"][0] and "world size 1" in said0["said"][0], said0
