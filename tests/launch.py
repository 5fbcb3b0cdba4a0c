"""Launch multi-process test scripts under torchrun, with a timeout and full cleanup (all suites)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardkeeper.core.testing.procs import kill_tree

WORKER_MAIN = Path(__file__).with_name("worker_main.py")


def run_script(
    nproc: int,
    script: str | Path,
    *args: str,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    torchrun: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` gloo ranks under torchrun (plain python when ``nproc`` is 1,
    unless ``torchrun``: a framework that needs the launcher's environment even for one rank).

    torchrun ``--standalone`` picks a free port. On timeout every process under the launch
    prints its stacks (faulthandler) and is killed; stdout and stderr come back together in
    ``.stdout``.
    """
    entry = [str(WORKER_MAIN), str(script)]  # skips the C++ teardown after a clean exit (see it)
    if nproc == 1 and not torchrun:
        cmd = [sys.executable, *entry, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *entry,
            *args,
        ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc, dump_stacks=True)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "(no output: a process outside the launch's tree still holds the pipe)"
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout_s} s; output tail:\n{out[-12000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
