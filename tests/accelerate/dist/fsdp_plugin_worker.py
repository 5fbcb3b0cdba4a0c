"""GPU only: Accelerate's own FSDP plugin (version 1 or 2) under shardkeeper's save/load_state.

``fsdp_plugin_worker.py VERSION OUT``: train 3 steps, save_state, train 3 more (recording the
losses), load_state, train the 3 steps again: losses and full parameters bit-exact; the saved
keys are the canonical, unsharded ones. Writes ``OUT/fsdp<VERSION>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager

VERSION, OUT = int(sys.argv[1]), sys.argv[2]
checks: dict[str, object] = {}


def check(name: str, ok: bool, detail: str = "") -> None:
    checks[name] = True if ok else (detail or "failed")


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
    model = acc.prepare(model)  # FSDP wants the model before the optimizer
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
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
    bad = [k for k in want if acc.is_main_process and not torch.equal(want[k], got[k])]
    check("params_bit_exact_after_load", not bad, str(bad))
    it = iter(dl)
    again = steps(3)
    check("next_losses_bit_exact", all(torch.equal(a, b) for a, b in zip(first, again)), f"{first} vs {again}")
    with CheckpointManager(root) as mgr:
        leaves = mgr.manifest().leaves
    check("canonical_global_keys", list(leaves["model/0.weight"].shape) == [32, 8]
          and any(k.startswith("optim/state/0.weight/") for k in leaves), str(sorted(leaves)[:8]))
    acc.end_training()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        checks["exception"] = traceback.format_exc()
    with open(os.path.join(OUT, f"fsdp{VERSION}-rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(checks, f, indent=1)
