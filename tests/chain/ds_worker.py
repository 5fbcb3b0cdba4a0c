"""Hop 1: a DeepSpeed ZeRO-3 fp32 engine (world size 2) trains 3 steps and saves through the
engine hook (``shardkeeper.deepspeed.attach(engine)`` + ``engine.save_checkpoint(root)``).

    ds_worker.py ROOT OUT
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # before any engine is built
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import shardkeeper.deepspeed  # noqa: E402
from tests.chain.common import FQNS, MOMENTS, Hop, Net, adam, committed_steps, loss_of, record, run_hop  # noqa: E402

STEPS = 3
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
    "steps_per_print": 10**9,
}


def engine_record(hop: Hop, engine) -> dict[str, torch.Tensor]:
    """DeepSpeed's own view of what it saved: full fp32 masters and moments
    (``safe_get_full_*``, collectives), and the base optimizer's ``step`` (ZeRO keeps one per
    flat partition; here every partition must hold the same)."""
    params, states = {}, {}
    for n, p in engine.module.named_parameters():
        params[n] = safe_get_full_fp32_param(p)
        states[n] = {k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    hop.check("DeepSpeed holds one Adam step for every partition", len(steps) == 1, str(steps))
    if len(steps) == 1:
        for n in FQNS:
            states[n]["step"] = next(iter(steps))
    return record(params, states)


def run(hop: Hop, root: str) -> None:
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=adam(model.parameters()), config=CONFIG)
    for k in range(STEPS):
        engine.backward(loss_of(engine, k, dist.get_rank()))
        engine.step()
    hop.check(
        "step count: engine.global_steps after training equals the steps trained",
        engine.global_steps == STEPS,
        f"engine.global_steps = {engine.global_steps}, trained {STEPS}",
    )
    before = committed_steps(root)
    hook = shardkeeper.deepspeed.attach(engine)  # the directory given to save_checkpoint is the root
    engine.save_checkpoint(root)  # tag None: the step is engine.global_steps
    hook.wait()
    state = engine_record(hop, engine)
    hop.saved(before, committed_steps(root), STEPS, state, "a fresh run: the steps trained")
    hook.detach()
    engine.destroy()


def _teardown() -> None:
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_hop("deepspeed", run, setup=lambda: deepspeed.init_distributed(dist_backend="gloo"), teardown=_teardown)
