"""CUDA only: Accelerate's FSDP plugin (versions 1 and 2) with shardkeeper's save/load_state.

Accelerate's FSDP plugin does not run on CPU; the CPU suite covers the same adapter code with a
``fully_shard`` model (test_ddp_resume.py). Run on a CUDA machine: ``pytest -m cuda tests/accelerate``
(``benchmarks/gpu.py`` does), on one GPU (one rank under torchrun) and, where there are two, two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checks import assert_checks, read_checks
from tests.launch import run_script

WORKER = Path(__file__).parent / "dist" / "fsdp_plugin_worker.py"
EXPECTED = {"distributed_type", "params_bit_exact_after_load", "next_losses_bit_exact", "canonical_global_keys"}

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate's FSDP plugin needs CUDA"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_plugin_save_load_bit_exact(version: int, nproc: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"shards over {nproc} GPUs; this machine has {torch.cuda.device_count()}")
    proc = run_script(nproc, WORKER, str(version), str(tmp_path), timeout_s=60, torchrun=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = read_checks(*(tmp_path / f"fsdp{version}-rank{rank}.json" for rank in range(nproc)), output=proc.stdout)
    assert_checks(checks, sorted(EXPECTED), where=f"FSDP{version}")
