"""One model state saved under every core layout (tests/core/save/test_logical_matrix.py).

    logical_matrix_worker.py REF ROOT

Every rank reads REF (a safetensors file of a model's parameters, buffers and AdamW state,
built and trained in one process by the test), and for each layout of ``layouts.LAYOUTS``
this world supports builds the model so distributed, loads REF into it through torch's
full state dict (parameters and optimizer state alike), and saves it at step 1 under
``ROOT/<layout>``. The test compares the manifests' logical digests with the state's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from layouts import LAYOUTS, Net, build, supported
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardkeeper.core import CheckpointManager

FULL = StateDictOptions(full_state_dict=True)


def reference(ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """REF as torch's full model and optimizer state dicts (keyed by FQN)."""
    plain = Net()
    plain.load_state_dict({k.removeprefix("model/"): v for k, v in ref.items() if k.startswith("model/")})
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    for fqn, p in plain.named_parameters():
        prefix = f"optim/state/{fqn}/"
        opt.state[p] = {k.removeprefix(prefix): v.clone() for k, v in ref.items() if k.startswith(prefix)}
    return get_model_state_dict(plain, options=FULL), get_optimizer_state_dict(plain, opt, options=FULL)


def main(ref_path: Path, root: Path) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    ref = load_file(str(ref_path))
    msd, osd = reference(ref)
    for layout in LAYOUTS:
        if not supported(layout, world):
            continue
        model, opt = build(layout, seed=1)
        if layout == "fsdp1":  # its full state dict does not load on CPU: write the parameters whole
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
                for k, v in [*model.named_parameters(), *model.named_buffers()]:
                    v.copy_(ref[f"model/{k.removeprefix('_fsdp_wrapped_module.')}"])
        else:
            set_model_state_dict(model, dict(msd), options=FULL)  # torch renames the keys it is given
        set_optimizer_state_dict(model, opt, copy.deepcopy(osd), options=FULL)
        with CheckpointManager(root / layout) as mgr:
            mgr.save(1, {"model": model, "optim": opt}, async_save=False)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
