"""CUDA state through real process groups: NCCL at world size 1; DTensor shards of two
gloo ranks on the one GPU, restored at world size 2 and resharded at world size 1; and
replicated state of two ranks restored with each replicated byte read from storage once.

Workers live in ``tests/cuda/dist`` and run under ``tests.launch.run_script`` (torchrun for
two ranks, a timeout, the process tree killed after). They choose their device as the tests
do (``tests/cuda/_device.py``: the environment is inherited).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.checks import assert_checks, assert_same_state, read_checks, state_of
from tests.cuda._model import devices_of, fresh
from tests.launch import run_script

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.timeout(240)]

DIST = Path(__file__).parent / "dist"
LAUNCH_TIMEOUT_S = 60.0  # within benchmarks/gpu.py's part limit, so a hang is named, not cut


def test_nccl_world_size_1_save_restore(tmp_path: Path) -> None:
    res = run_script(1, DIST / "nccl_worker.py", str(tmp_path), timeout_s=LAUNCH_TIMEOUT_S)
    checks = read_checks(tmp_path / "r0.json", output=res.stdout)
    assert_checks(checks, ["backend", "committed", "restore is bit for bit", "save and restore"])
    assert res.returncode == 0, res.stdout[-4000:]


def _full_reference(out: Path) -> dict[str, torch.Tensor]:
    """The full tensors of the sharded state as the ranks saved it: row shards concatenated,
    replicated values (buffers, AdamW's step count) taken from rank 0 after checking that
    rank 1 holds the same."""
    from safetensors.torch import load_file

    r0, r1 = (load_file(str(out / f"ref-r{r}.safetensors")) for r in range(2))
    assert r0.keys() == r1.keys()
    full = {}
    for k in r0:
        if k.startswith("buffer/") or k.endswith("/step"):
            assert torch.equal(r0[k], r1[k]), f"{k} differs between the ranks"
            full[k] = r0[k]
        else:
            full[k] = torch.cat([r0[k], r1[k]], dim=0)
    return full


def test_dtensor_shards_world_size_2_then_resharded_to_1(tmp_path: Path, device: torch.device) -> None:
    res = run_script(2, DIST / "dtensor_worker.py", str(tmp_path), timeout_s=LAUNCH_TIMEOUT_S)
    checks = read_checks(*(tmp_path / f"r{r}.json" for r in range(2)), output=res.stdout)
    assert_checks(checks, ["sharded save and restore", "restore at world size 2 is bit for bit", "committed"])
    assert res.returncode == 0, res.stdout[-4000:]

    want = _full_reference(tmp_path)
    assert "optim/fc1.weight/exp_avg" in want and want["param/fc1.weight"].shape == (32, 16)
    # World size 1: the same checkpoint into full tensors on the device, in this process.
    model, opt = fresh(device)
    before = devices_of(model, opt)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore({"model": model, "optim": opt}, step=3) == 3
    assert devices_of(model, opt) == before, "a restored tensor moved to another device"
    got = state_of(model, opt)
    assert_same_state(got, want, subset=True, what="the resharded restore at world size 1")
    assert {k for k in got if not k.startswith("optim/param_groups")} == set(want)


def test_replicated_state_restored_with_each_byte_read_once(tmp_path: Path) -> None:
    res = run_script(2, DIST / "share_worker.py", str(tmp_path), timeout_s=LAUNCH_TIMEOUT_S)
    checks = read_checks(*(tmp_path / f"r{r}.json" for r in range(2)), output=res.stdout)
    assert_checks(
        checks,
        ["replica-deduplicated restore on the device", "shared: bit for bit", "shared: read <= 1.05 x the checkpoint",
         "not shared: every rank read it all (control)"],
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:]
