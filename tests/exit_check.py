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
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(REPO)
    )
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc.returncode, results, proc.stderr


def saved_at_exit(script: Path, tmp_path: Path, width: int, trials: int) -> list[str]:
    """Run ``script ROOT WIDTH`` ``trials`` times (a fresh root each), assert each run exited 0
    after reporting its save; return the roots. The script writes ``ROOT.ref.safetensors``."""
    roots = []
    for trial in range(trials):
        root = str(tmp_path / f"r{trial}")
        rc, results, err = run_python(script, root, str(width))
        assert rc == 0 and results == [{"saved": True}], f"trial {trial}: {err[-3000:]}"
        roots.append(root)
    return roots


def restores_as_saved(root: str, target: dict, module: object) -> None:
    """The newest step under ``root`` exists and restores ``module`` (inside ``target``) bit
    for bit to the script's reference."""
    from safetensors.torch import load_file

    from shardkeeper.core import CheckpointManager
    from tests.checks import assert_same_state

    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() is not None, f"the last save under {root} was lost at exit"
        mgr.restore(target, only=["model/*"])
    ref = load_file(root + ".ref.safetensors")
    assert_same_state(module.state_dict(), ref, what=f"the module restored from {root}")  # type: ignore[attr-defined]
