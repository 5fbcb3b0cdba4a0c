"""One phase of ``ranks16.py`` on every rank (under torchrun, gloo).

    _ranks16_worker.py save|restore ROOT_URL OPTIONS_JSON OUT_DIR

save: per layout (``fsdp2``: FSDP2 over all ranks, recorded by its layout rule; ``ddp``: DDP,
replicated plain tensors) train one step, save, and (rank 0) write the full parameters and
AdamW state as the reference. restore: restore each checkpoint into a fresh model of the same
layout and into the other layout, and compare with the reference bit for bit. Each rank
writes ``OUT_DIR/<phase>-r<rank>.json``: its store calls and bytes (the save's commit
protocol, counted by a wrapper around the c10d store) and its restore statistics.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _counting import CountingStore  # noqa: E402

LAYOUTS = ("fsdp2", "ddp")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(6)])
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: nn.Module = Net()
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as full tensors, keyed by name (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, st in get_optimizer_state_dict(model, opt, options=opts)["state"].items():
        out.update({f"optim/{fqn}/{n}": v for n, v in st.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in out.items()}


def count_store() -> list[CountingStore]:
    """Every coordinator's store calls, counted (the save protocol's round trips and bytes)."""
    from shardkeeper.core.runtime import coordinator as coordination

    made: list[CountingStore] = []
    orig = coordination.StoreCoordinator._store

    def counted(self: Any) -> Any:
        wrapper = self.__dict__.get("_counting")
        if wrapper is None:
            wrapper = self.__dict__["_counting"] = CountingStore(orig.fget(self))  # type: ignore[attr-defined]
            made.append(wrapper)
        return wrapper

    coordination.StoreCoordinator._store = property(counted)  # type: ignore[method-assign,assignment]
    return made


def main(phase: str, root: str, options: str, out: str) -> None:
    from shardkeeper.core import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    opts = json.loads(options)
    stores = count_store()
    seen: dict[str, Any] = {"rank": rank}
    if phase == "save":
        for layout in LAYOUTS:
            model, opt = build(layout, seed=1)
            train_step(model, opt)
            group = int(os.environ.get("RANKS16_GROUP_RANKS", "128"))  # ranks16.py --group-ranks
            with CheckpointManager(
                f"{root}/{layout}", storage_options=opts, describe_layouts=True, commit_group_ranks=group
            ) as mgr:
                before = sum((s.calls for s in stores), Counter())
                mgr.save(1, {"model": model, "optim": opt}, async_save=False)
                calls = sum((s.calls for s in stores), Counter()) - before
            ref = full_state(model, opt)
            if rank == 0:
                from safetensors.torch import save_file

                save_file(ref, os.path.join(out, f"{layout}.ref.safetensors"))
            seen[layout] = {"store_calls": dict(calls), "report_bytes": sum(s.sent for s in stores)}
            for s in stores:
                s.sent = 0
    else:
        from safetensors.torch import load_file

        for src in LAYOUTS:
            ref = load_file(os.path.join(out, f"{src}.ref.safetensors"))
            for layout in LAYOUTS:
                model, opt = build(layout, seed=2)
                train_step(model, opt)  # AdamW state exists, all of it different from the saved
                with CheckpointManager(f"{root}/{src}", storage_options=opts) as mgr:
                    mgr.restore({"model": model, "optim": opt})
                    st = mgr.last_restore_stats
                got = full_state(model, opt)
                wrong = sorted(k for k in ref if not (k in got and torch.equal(got[k], ref[k])))
                seen[f"{src}->{layout}"] = {
                    "wrong": wrong[:5],
                    "keys": len(ref),
                    "bytes_read": st.bytes_read,
                    "bytes_received": st.bytes_received,
                    "bytes_needed": st.bytes_needed,
                    "index_files": st.index_files,
                }
    with open(os.path.join(out, f"{phase}-r{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
