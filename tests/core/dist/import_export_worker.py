"""Two-rank FSDP2 run for the export and import tests (run under torchrun):

    import_export_worker.py OUT

trains the layout matrix's model 2 steps under FSDP2, then writes the same state twice:
a shardkeeper checkpoint (step 2, ``OUT/sk``, sharded by both ranks), a
``torch.distributed.checkpoint`` save of ``get_state_dict`` (``OUT/dcp``) and a checkpoint
with int8-quantized Adam moments (``OUT/q``, then restored into a fresh FSDP2 model at 2 ranks:
``OUT/q-restore-r<rank>.json``: the checks, ``tests.checks.Checks``); rank 0 writes the
full reference state (parameters and AdamW state, canonical keys) to ``OUT/ref.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build, full_state, train_step  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402
from shardkeeper.core.state.quantize import dequantize_int8, quantize_int8, quantized  # noqa: E402
from tests.checks import Checks  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    model, opt = build("fsdp2", seed=1)
    for i in range(2):
        train_step(model, opt, i)
    with CheckpointManager(out / "sk", digest_block_bytes=3000) as mgr:
        mgr.save(2, {"model": model, "optim": opt, "progress": {"step": 2}}, async_save=False)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "progress": {"step": 2}}, checkpoint_id=str(out / "dcp"))
    with CheckpointManager(out / "q") as mgr:  # int8 moments, sharded by rows on 2 ranks
        mgr.save(2, {"model": model, "optim": quantized(opt, model, mode="int8", block=48)}, async_save=False)
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        save_file(ref, str(out / "ref.safetensors"))
    # the int8 checkpoint back into FSDP2 at 2 ranks: codes and scales land in DTensor shards
    model2, opt2 = build("fsdp2", seed=7)
    with CheckpointManager(out / "q") as mgr:
        mgr.restore({"model": model2, "optim": quantized(opt2, model2, mode="int8", block=48)})
    want = {}
    for k, v in ref.items():  # the moments of 2-D parameters come back as their int8 round trip
        name = k.rsplit("/", 1)[-1]
        if not (k.startswith("model/") or name == "step" or v.dim() < 2):
            root = name == "exp_avg_sq"
            v = dequantize_int8(*quantize_int8(v, 48, root), 48, root, torch.float32)
        want[k] = v
    checks = Checks(out / f"q-restore-r{dist.get_rank()}.json")
    checks.check("int8 restore: the reference holds parameters and moments", len(want) > 10, sorted(want))
    checks.same("int8 restore at 2 ranks: parameters exact, moments their int8 round trip",
                full_state(model2, opt2), want)
    checks.write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
