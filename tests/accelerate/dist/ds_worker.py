"""The real Accelerator with DeepSpeed ZeRO on 2 gloo ranks (CPU): save, resume, compare.

``ds_worker.py MODE OUT STAGE``. ``save``: an uninterrupted reference run (TOTAL steps: losses, batches, final state), then
the same run interrupted after step STOP with save_state() after the steps in SAVE_AT
(total_limit=2). ``resume OUT``: a new process with other seeds load_state()s, checks the
engine's fp32 masters and Adam moments (DeepSpeed's own ``safe_get_full_*``) bit for bit, the
counters, the registered object and the scheduler, trains to TOTAL and compares the losses,
the batches and the final state with the reference bit for bit.

On CPU, Accelerate's own bookkeeping sees one process per rank (``num_processes == 1``), so
its DataLoader is not split and its computed ``train_batch_size`` would be a rank's; the
DeepSpeed config therefore gives the batch sizes explicitly. DeepSpeed itself runs on the
2-rank gloo group torchrun made. Each rank writes its checks to ``OUT/ds<stage>-<mode>-rank<r>.json``.
If DeepSpeed itself cannot train the stage (the reference run, which involves no shardkeeper
call but ``enable()``, fails) on a DeepSpeed older than 0.19, the save records a skip,
``deepspeed_cannot_train``, and the test skips: DeepSpeed 0.18's ZeRO-1/2 step fails on torch
2.13 on CPU ("Output 0 of Split is a view and is being modified inplace").
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

import deepspeed  # noqa: E402  (after torch)

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import shardkeeper.accelerate as ska  # noqa: E402
from shardkeeper.core import CheckpointManager  # noqa: E402
from tests.checks import Checks, state_diff  # noqa: E402

MODE, OUT, STAGE = sys.argv[1], sys.argv[2], int(sys.argv[3])
TOTAL, STOP = 10, 5
SAVE_AT = (2, 4, STOP)
MOMENTS = ("exp_avg", "exp_avg_sq")
DS_CONFIG = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": STAGE}, "steps_per_print": 10**9,
}
checks = Checks()
check = checks.check


class Counter:
    """A registered object: restored by load_state through extra/custom/0."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def make_model() -> nn.Module:
    # 4*15+15, 15*1+1: sizes that do not divide by the world size
    return nn.Sequential(nn.Linear(4, 15), nn.Dropout(0.2), nn.ReLU(), nn.Linear(15, 1))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.arange(40), torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))


def setup(acc: Accelerator, seed: int):
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # Accelerate's, not DeepSpeed's
    dl = DataLoader(dataset(), batch_size=4, shuffle=True)  # 10 batches per epoch (not split: see above)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    engine, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    return engine, opt, sched, dl, counter


def train(acc, engine, opt, sched, dl, counter, start: int, end: int, save_at=()):
    step, losses, seen = start, [], []
    while step < end:
        for idx, x, y in dl:
            loss = ((engine(x) - y) ** 2).mean()
            acc.backward(loss)  # DeepSpeed's backward and step
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            counter.n += 1
            losses.append(loss.detach().clone())
            seen.append(idx.tolist())
            if step in save_at:
                acc.save_state()
            if step >= end:
                break
    return losses, seen


def snapshot(engine) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full view of the fp32 masters and moments (a collective)."""
    out = {}
    for n, p in engine.module.named_parameters():
        out[f"param/{n}"] = safe_get_full_fp32_param(p).clone()
        for m in MOMENTS:
            out[f"{m}/{n}"] = safe_get_full_optimizer_state(p, m).clone()
    return out


def make_accelerator(proj: str) -> Accelerator:
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DS_CONFIG)),
        project_config=ProjectConfiguration(project_dir=proj, automatic_checkpoint_naming=True, total_limit=2),
    )


def main() -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    proj = os.path.join(OUT, f"ds{STAGE}-proj")
    acc = make_accelerator(proj)
    check("distributed_type", str(acc.distributed_type.value) == "DEEPSPEED", str(acc.distributed_type))
    if MODE == "save":
        ska.enable(acc)  # async saves (the default)
        parts = setup(acc, seed=0)
        try:
            losses, seen = train(acc, *parts, 0, TOTAL)  # no save: DeepSpeed and Accelerate only
        except RuntimeError as e:
            if tuple(int(x) for x in deepspeed.__version__.split(".")[:2]) >= (0, 19):
                raise
            checks.skip("deepspeed_cannot_train", f"DeepSpeed {deepspeed.__version__} ZeRO-{STAGE}: {e}")
            return
        torch.save({"losses": losses, "seen": seen, "final": snapshot(parts[0]), "n": parts[4].n},
                   os.path.join(OUT, f"ds{STAGE}-ref-{rank}.pt"))
        acc.free_memory()
        acc._custom_objects.clear()
        parts = setup(acc, seed=0)
        losses, _ = train(acc, *parts, 0, STOP, save_at=SAVE_AT)
        ska.wait(acc)
        check("world_size_2", dist.get_world_size() == 2, str(dist.get_world_size()))
        torch.save({"at_save": snapshot(parts[0]), "losses": losses}, os.path.join(OUT, f"ds{STAGE}-interrupted-{rank}.pt"))
        ref = torch.load(os.path.join(OUT, f"ds{STAGE}-ref-{rank}.pt"))
        check("interrupted_run_matches_reference_so_far",
              all(torch.equal(a, b) for a, b in zip(losses, ref["losses"][:STOP])))
        with CheckpointManager(os.path.join(proj, "checkpoints")) as mgr:
            check("retention_total_limit_2", mgr.steps() == [1, 2], str(mgr.steps()))
            m = mgr.manifest()
            keys = set(m.leaves)
        want = {"model/0.weight", "model/3.bias", "optim/state/0.weight/exp_avg_sq", "optim/param_groups",
                "sched/last_epoch", "progress/step", "progress/deepspeed/global_step", "progress/accelerate/iteration",
                "progress/accelerate/step", "extra/custom/0/n", "rng/0/torch", "rng/1/torch", "data/1/0/batches_seen"}
        check("canonical_keys", want <= keys and m.world_size == 2, f"missing {sorted(want - keys)}, world {m.world_size}")
        check("global_shapes", list(m.leaves["model/0.weight"].shape) == [15, 4], str(m.leaves["model/0.weight"].shape))
        acc.end_training()
    else:
        resume(acc, rank, proj)


def resume(acc: Accelerator, rank: int, proj: str) -> None:
    ref = torch.load(os.path.join(OUT, f"ds{STAGE}-ref-{rank}.pt"))
    before = torch.load(os.path.join(OUT, f"ds{STAGE}-interrupted-{rank}.pt"))
    ska.enable(acc, async_save=False)
    engine, opt, sched, dl, counter = setup(acc, seed=99)  # other seeds: restore must matter
    step = acc.load_state()
    check("restored_newest_step", step == 2, str(step))
    check("iteration_counter_restored", acc.project_configuration.iteration == 3,
          str(acc.project_configuration.iteration))
    check("engine_global_steps_restored", engine.global_steps == STOP, str(engine.global_steps))
    checks.same("fp32_masters_and_moments_bit_exact_after_load", snapshot(engine), before["at_save"])
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: partitioned
        lp = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = {k: v for k, v in before["at_save"].items() if k.startswith("param/")}
    checks.same("module_params_equal_masters", {f"param/{n}": v for n, v in lp.items()}, masters)
    check("registered_object_restored", counter.n == STOP, str(counter.n))
    check("scheduler_restored", sched.scheduler.last_epoch == STOP, str(sched.scheduler.last_epoch))
    check("dataloader_epoch_restored", dl.iteration == 0, str(dl.iteration))

    # plain torch, through the core: the same step into an unwrapped model, AdamW and StepLR
    pm = make_model()
    popt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    psched = torch.optim.lr_scheduler.StepLR(popt, step_size=3, gamma=0.5)
    with CheckpointManager(os.path.join(proj, "checkpoints")) as mgr:
        mgr.restore({"model": pm, "optim": popt, "sched": psched}, step=2, only=["model/*", "optim/*", "sched/*"])
    got = {}
    for n, p in pm.named_parameters():
        got[f"param/{n}"] = p.detach()
        got.update({f"{m}/{n}": popt.state[p][m] for m in MOMENTS if p in popt.state})
    err = state_diff(got, before["at_save"])
    check("plain_torch_restores_deepspeed_checkpoint", not err and psched.last_epoch == STOP,
          f"{err or 'state equal'}; last_epoch={psched.last_epoch}")

    losses, seen = train(acc, engine, opt, sched, dl, counter, STOP, TOTAL, save_at=(7,))
    check("dataloader_resumes_at_right_batch", seen == ref["seen"][STOP:], f"{seen} vs {ref['seen'][STOP:]}")
    bad = [i for i, (a, b) in enumerate(zip(losses, ref["losses"][STOP:])) if not torch.equal(a, b)]
    check("next_losses_bit_exact", len(losses) == TOTAL - STOP and not bad, f"steps differ: {bad}")
    checks.same("final_state_bit_exact", snapshot(engine), ref["final"])
    check("registered_object_final", counter.n == ref["n"], f"{counter.n} vs {ref['n']}")
    with CheckpointManager(os.path.join(proj, "checkpoints")) as mgr:
        check("retention_across_restart", mgr.steps() == [2, 3], str(mgr.steps()))
    acc.end_training()


if __name__ == "__main__":
    checks.guard("whole run", main)
    checks.write(os.path.join(OUT, f"ds{STAGE}-{MODE}-rank{checks.rank}.json"))
