"""Quantized optimizer state (lossy, opt-in): int8 codes and bf16 moments round-trip within
their stated error, everything else exactly; a quantized checkpoint refuses a plain
optimizer. (The reshard from 2 FSDP2 ranks to 1 is tested in tests/core/tools/test_export_import.py, which
owns that launch.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.state.quantize import dequantize_int8, quantize_int8, quantized
from shardkeeper.core.storage import open_storage

from ..dist.layouts import build, full_state, train_step

pytestmark = [pytest.mark.timeout(300)]


def test_int8_blocks_bound_the_error() -> None:
    x = torch.randn(7, 130) * torch.logspace(-3, 2, 130)
    x[2] = 0  # an all-zero row: scale 0, codes 0, exact
    q, s = quantize_int8(x, 64, root=False)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == (7, 3)
    back = dequantize_int8(q, s, 64, False, torch.float32)
    bound = torch.repeat_interleave(s, 64, dim=-1)[:, :130] / 254 * (1 + 1e-6)
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[2], x[2])
    v = x.abs() ** 2
    qv, sv = quantize_int8(v, 64, root=True)  # second moments: quantized as their root
    assert torch.all(dequantize_int8(qv, sv, 64, True, torch.float32) >= 0)


def _trained(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = build("plain", seed=seed)
    for i in range(3):
        train_step(model, opt, i)
    return model, opt


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_quantized_moments_round_trip(tmp_path: Path, mode: str) -> None:
    model, opt = _trained()
    ref = full_state(model, opt)
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(3, {"model": model, "optim": quantized(opt, model, mode=mode)}, async_save=False)
    m = load_manifest(open_storage(str(tmp_path / "r")), 3)
    assert m.metadata["quantized"]["optim"]["mode"] == mode and m.metadata["quantized"]["optim"]["lossy"]
    moment = "optim/state/big.weight/exp_avg"
    if mode == "bf16":
        assert m.leaves[moment].dtype == "bfloat16"
    else:
        assert m.leaves[moment + "/q"].dtype == "int8" and m.leaves[moment + "/scale"].dtype == "float32"
    model2, opt2 = build("plain", seed=9)
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.restore({"model": model2, "optim": quantized(opt2, model2, mode=mode)})
    got = full_state(model2, opt2)
    lossy: list[bool] = []
    for k, want in ref.items():
        name = k.rsplit("/", 1)[-1]
        if k.startswith("model/") or name == "step" or want.dim() < 2:
            assert torch.equal(got[k], want), k  # exact
        elif mode == "bf16":
            assert torch.equal(got[k], want.to(torch.bfloat16).float()), k
        else:
            root = name == "exp_avg_sq"
            assert torch.equal(got[k], dequantize_int8(*quantize_int8(want, 64, root), 64, root, torch.float32)), k
            lossy.append(not torch.equal(got[k], want))
    assert mode == "bf16" or any(lossy)  # int8 is lossy, and the test can tell
    assert opt2.param_groups[0]["lr"] == 1e-2
    model3, opt3 = build("plain", seed=9)
    with CheckpointManager(tmp_path / "r") as mgr, pytest.raises(StateMismatchError, match="saved quantized"):
        mgr.restore({"model": model3, "optim": opt3})
