"""The core's workers live in ``tests/core/dist``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

DIST_DIR = Path(__file__).parent / "dist"


def run_workers(
    nproc: int, script: str, *args: str, timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``dist/<script>`` on ``nproc`` ranks; see ``tests.launch.run_script``."""
    return run_script(nproc, DIST_DIR / script, *args, timeout_s=timeout_s, env=env)


def run_codecs_worker(tmp_path: Path, runs: list[dict[str, Any]], timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """One 3-rank launch of ``dist/codecs_worker.py`` over ``runs`` (``{"name", "url",
    "options", "mode"}``); every check of every rank, after asserting the launch succeeded and
    every check passed."""
    res = run_workers(3, "codecs_worker.py", str(tmp_path / "results"), json.dumps(runs), timeout_s=timeout_s)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(3)), output=res.stdout)
    assert_checks(checks)
    return checks
