"""The same model state saved under every core layout records the same logical digests, and
they are ``logical_digest`` of the tensors of that model built in one process.

This process builds the layout matrix's model (tests/core/dist/layouts.py), trains it one
step (so AdamW has state) and saves it plainly; one 4-rank launch
(``dist/logical_matrix_worker.py``) loads that state into DDP, FSDP1, FSDP2, TP and
FSDP2+TP models and saves each. Every manifest's digests, read with ``shardkeeper inspect
--json``, must equal this process's ``logical_digest`` of every parameter, buffer and
optimizer state tensor; with one parameter one ulp off they must not.

Under FSDP2+TP the tensors sharded over the data-parallel submesh alone are written twice
(every copy on the tensor-parallel dimension writes the same chunks): the coordinator keeps
one of each and takes the digest from ranks that cover the tensor once, so they record the
same digests as every other layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from tests.logical_matrix import assert_matrix, expected_digests, inspect_digests, one_ulp_off

from .._launch import run_workers
from ..dist.layouts import build, train_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

LAYOUTS = ("plain", "fsdp1", "fsdp2", "tp", "fsdp2_tp")


def _one_process_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The model, its optimizer and their tensors keyed as a checkpoint keys them."""
    model, opt = build("plain", seed=1)
    train_step(model, opt, 0)
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        for name, v in opt.state[p].items():
            tensors[f"optim/state/{fqn}/{name}"] = v.detach().clone()
    return model, opt, tensors


def test_every_layout_records_the_one_process_digests(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, opt, tensors = _one_process_state()
    assert len(tensors) == 11 + 3 * 10, sorted(tensors)  # 10 parameters, 1 buffer; 3 AdamW tensors each
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    with CheckpointManager(tmp_path / "one-process") as mgr:
        mgr.save(1, {"model": model, "optim": opt}, async_save=False)
    res = run_workers(4, "logical_matrix_worker.py", str(tmp_path / "ref.safetensors"), str(tmp_path), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    roots = [("one process", tmp_path / "one-process", 1), *((f"{n} at 4 ranks", tmp_path / n, 1) for n in LAYOUTS)]
    # every layout saved every tensor of the state and no other, each with a digest
    for name, root, step in roots:
        recorded = inspect_digests(root, step)
        assert set(recorded) == set(tensors), (name, sorted(set(recorded) ^ set(tensors)))
        missing = {k for k, d in recorded.items() if d is None}
        assert not missing, (name, sorted(missing))
    assert_matrix(roots, tensors)


def test_a_one_ulp_change_in_the_expected_model_fails_the_compare(tmp_path: Path) -> None:
    _, _, tensors = _one_process_state()
    key = "model/fc1.weight"
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}})
    model_only = {k: v for k, v in tensors.items() if k.startswith("model/")}
    assert_matrix([("saved", tmp_path, 1)], model_only)
    with pytest.raises(AssertionError, match=f"saved: {key}: recorded [0-9a-f]{{16}}, one process gives"):
        assert_matrix([("saved", tmp_path, 1)], one_ulp_off(model_only, key))
    assert expected_digests(one_ulp_off(model_only, key))[key] != expected_digests(model_only)[key]
