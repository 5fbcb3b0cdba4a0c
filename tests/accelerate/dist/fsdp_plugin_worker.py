"""GPU only: Accelerate's own FSDP plugin (version 1 or 2) under shardkeeper's save/load_state.

``fsdp_plugin_worker.py VERSION OUT``: train 3 steps, save_state, train 3 more (recording the
losses), load_state, train the 3 steps again: losses and full parameters bit-exact; the saved
keys are the canonical, unsharded ones. Writes its checks to ``OUT/fsdp<VERSION>-rank<r>.json``.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager
from tests.checks import Checks

VERSION, OUT = int(sys.argv[1]), sys.argv[2]
checks = Checks()
check = checks.check


def full_params(acc: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()}


def main() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=VERSION, cpu_ram_efficient_loading=False)
    acc = Accelerator(fsdp_plugin=plugin)
    check("distributed_type", str(acc.distributed_type.value) == "FSDP", str(acc.distributed_type))
    ska.enable(acc, async_save=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    if VERSION == 1:  # FSDP1 wants the model wrapped before the optimizer is made
        model = acc.prepare(model)
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:  # FSDP2 swaps the optimizer's parameters for DTensors: both in one call
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    dl = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
    it = iter(dl)

    def steps(n: int) -> list[torch.Tensor]:
        out = []
        for _ in range(n):
            x, y = next(it)
            loss = ((model(x) - y) ** 2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(loss.detach().cpu().clone())
        return out

    steps(3)
    root = os.path.join(OUT, f"fsdp{VERSION}")
    acc.save_state(root)
    want = full_params(acc, model)
    first = steps(3)
    acc.load_state(root)
    got = full_params(acc, model)
    if acc.is_main_process:  # the full state dict is gathered on the main process only
        checks.same("params_bit_exact_after_load", got, want)
    else:
        check("params_bit_exact_after_load", True)
    it = iter(dl)
    again = steps(3)
    check("next_losses_bit_exact", all(torch.equal(a, b) for a, b in zip(first, again)), f"{first} vs {again}")
    with CheckpointManager(root) as mgr:
        leaves = mgr.manifest().leaves
    check("canonical_global_keys", list(leaves["model/0.weight"].shape) == [32, 8]
          and any(k.startswith("optim/state/0.weight/") for k in leaves), str(sorted(leaves)[:8]))
    acc.end_training()


if __name__ == "__main__":
    checks.guard("whole run", main)
    checks.write(os.path.join(OUT, f"fsdp{VERSION}-rank{checks.rank}.json"))
