"""The core's workers live in ``tests/core/dist``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.launch import run_script

DIST_DIR = Path(__file__).parent / "dist"


def run_workers(
    nproc: int, script: str, *args: str, timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``dist/<script>`` on ``nproc`` ranks; see ``tests.launch.run_script``."""
    return run_script(nproc, DIST_DIR / script, *args, timeout_s=timeout_s, env=env)
