"""Run a user's script as its own interpreter (plain ``python``, never through worker_main:
the interpreter's own exit is what the exit tests check) and read what it reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(script: Path, *args: str, timeout_s: float = 240.0) -> tuple[int, list[dict], str]:
    """Exit status, the ``RESULT {...}`` lines of stdout, and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=str(REPO))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc.returncode, results, proc.stderr
