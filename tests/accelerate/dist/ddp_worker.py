"""Real Accelerator(cpu=True) under torchrun (MULTI_CPU / gloo): save, resume, cross-restore.

``save OUT``: an uninterrupted reference run (12 steps, records losses, batches, final state),
then the same run interrupted after step 5 with save_state() after steps 1, 3 and 5
(total_limit=2). ``resume OUT``: a new process with other seeds load_state()s, trains steps
6..12 and compares with the reference bit for bit; then the retention, plain-torch, core-written,
step-folder, several-models and fully_shard (FSDP2) checks. Each rank writes its checks
(``tests.checks.Checks``) to ``OUT/<mode>-rank<r>.json``. With ``SHARDKEEPER_WRITER=process``
(read by ``enable()``), each mode also checks that persist processes wrote its saves and notes
their pids in ``OUT/persist-pids-<rank>``.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeeper.accelerate as ska
from shardkeeper.core import CheckpointManager
from tests.checks import Checks, state_diff, state_of
from tests.persist_probe import note_persist_processes

MODE, OUT = sys.argv[1], sys.argv[2]
TOTAL, STOP = 12, 5
SAVE_AT = (1, 3, STOP)
checks = Checks()
check = checks.check
PROCESS_WRITER = os.environ.get("SHARDKEEPER_WRITER") == "process"


class Counter:
    """A registered object: restored by load_state through extra/custom/0."""

    def __init__(self) -> None:
        self.n = 0
        self.t = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])
        self.t = sd["t"].clone()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.arange(64), torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))


def setup(acc: Accelerator, seed: int):
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = DataLoader(dataset(), batch_size=4, shuffle=True)  # 8 batches per rank per epoch
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    return model, opt, sched, dl, counter


def train(acc, model, opt, sched, dl, counter, start: int, end: int, save_at=()):
    step, losses, seen = start, [], []
    while step < end:
        for idx, x, y in dl:
            loss = ((model(x) - y) ** 2).mean()
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            counter.n += 1
            counter.t += 1.0
            losses.append(loss.detach().clone())
            seen.append(idx.tolist())
            if step in save_at:
                acc.save_state()
            if step >= end:
                break
    return losses, seen


def snapshot(model, opt) -> dict:
    """The unwrapped model's parameters and the inner optimizer's state, by FQN (``state_of``)."""
    return state_of(getattr(model, "module", model), getattr(opt, "optimizer", opt))


def note_writer(acc: Accelerator, root: str, rank: int) -> None:
    """With the process writer: the plugin's saves under ``root`` went through persist processes."""
    if PROCESS_WRITER:
        options = ska.plugin_of(acc).manager(root).options
        note_persist_processes(checks, MODE, options, os.path.join(OUT, f"persist-pids-{rank}"))


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    proj = os.path.join(OUT, "proj")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=proj, automatic_checkpoint_naming=True, total_limit=2))
    check("distributed_type", str(acc.distributed_type.value) == "MULTI_CPU", str(acc.distributed_type))
    if MODE == "save":
        ska.enable(acc)  # async saves (the default)
        model, opt, sched, dl, counter = setup(acc, seed=0)
        losses, seen = train(acc, model, opt, sched, dl, counter, 0, TOTAL)
        torch.save({"losses": losses, "seen": seen, "final": snapshot(model, opt), "n": counter.n},
                   os.path.join(OUT, f"ref-{rank}.pt"))
        acc.free_memory()
        acc._custom_objects.clear()
        model, opt, sched, dl, counter = setup(acc, seed=0)
        losses, seen = train(acc, model, opt, sched, dl, counter, 0, STOP, save_at=SAVE_AT)
        ska.wait(acc)
        note_writer(acc, os.path.join(proj, "checkpoints"), rank)
        torch.save({"at_save": snapshot(model, opt), "losses": losses}, os.path.join(OUT, f"interrupted-{rank}.pt"))
        ref = torch.load(os.path.join(OUT, f"ref-{rank}.pt"))
        check("interrupted_run_matches_reference_so_far",
              all(torch.equal(a, b) for a, b in zip(losses, ref["losses"][:STOP])))
        mgr = CheckpointManager(os.path.join(proj, "checkpoints"))
        check("retention_total_limit_2", mgr.steps() == [1, 2], str(mgr.steps()))
        mgr.close()
        acc.end_training()  # closes shardkeeper's managers first (wrapped)
    else:
        resume(acc, rank, proj)


def resume(acc: Accelerator, rank: int, proj: str) -> None:
    root = os.path.join(proj, "checkpoints")
    ref = torch.load(os.path.join(OUT, f"ref-{rank}.pt"))
    before = torch.load(os.path.join(OUT, f"interrupted-{rank}.pt"))
    ska.enable(acc, async_save=False)
    model, opt, sched, dl, counter = setup(acc, seed=99)  # other seeds: restore must matter
    step = acc.load_state()
    check("restored_newest_step", step == 2, str(step))
    check("iteration_counter_restored", acc.project_configuration.iteration == 3,
          str(acc.project_configuration.iteration))
    checks.same("params_and_optimizer_bit_exact_after_load", snapshot(model, opt), before["at_save"])
    check("registered_object_restored", counter.n == STOP and torch.equal(counter.t, torch.full((3,), float(STOP))),
          f"n={counter.n} t={counter.t}")
    # AcceleratedScheduler steps the scheduler once per process per step (split_batches=False)
    sched_steps = STOP * acc.num_processes
    check("scheduler_restored", sched.scheduler.last_epoch == sched_steps, str(sched.scheduler.last_epoch))
    check("dataloader_epoch_restored", dl.iteration == 0, str(dl.iteration))

    # plain torch, through the core: the same step into an unwrapped model and optimizer
    pm = make_model()
    popt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    psched = torch.optim.lr_scheduler.StepLR(popt, step_size=3, gamma=0.5)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": pm, "optim": popt, "sched": psched}, step=2, only=["model/*", "optim/*", "sched/*"])
    err = state_diff(state_of(pm, popt), before["at_save"])
    check("plain_torch_restores_accelerate_checkpoint", not err and psched.last_epoch == sched_steps,
          f"{err or 'state equal'}; scheduler last_epoch {psched.last_epoch}, want {sched_steps}")

    losses, seen = train(acc, model, opt, sched, dl, counter, STOP, TOTAL, save_at=(8, 10))
    note_writer(acc, root, rank)
    check("dataloader_resumes_at_right_batch", seen == ref["seen"][STOP:], f"{seen} vs {ref['seen'][STOP:]}")
    bad = [i for i, (a, b) in enumerate(zip(losses, ref["losses"][STOP:])) if not torch.equal(a, b)]
    check("next_losses_bit_exact", len(losses) == TOTAL - STOP and not bad, f"steps differ: {bad}")
    checks.same("final_params_and_optimizer_bit_exact", snapshot(model, opt), ref["final"])
    check("registered_object_final", counter.n == ref["n"], f"{counter.n} vs {ref['n']}")
    with CheckpointManager(root) as mgr:
        check("retention_across_restart", mgr.steps() == [3, 4], str(mgr.steps()))
    dirs = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    check("retention_removed_folders", dirs == ["step-000000000003", "step-000000000004"], str(dirs))

    # a step folder as input_dir, like accelerate's checkpoint_<n>
    acc.load_state(os.path.join(root, "step-000000000003"))
    check("step_folder_input_dir", acc.project_configuration.iteration == 4, str(acc.project_configuration.iteration))

    # a checkpoint written by the core directly restores through load_state
    core_root = os.path.join(OUT, "core-root")
    want = snapshot(model, opt)
    with CheckpointManager(core_root) as mgr:
        mgr.save(7, {"model": model, "optim": getattr(opt, "optimizer"), "sched": sched}, async_save=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for s in opt.optimizer.state.values():
            s["exp_avg"].mul_(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = acc.load_state(core_root)
    err = state_diff(snapshot(model, opt), want)
    check("core_written_checkpoint_restores", step == 7 and not err, f"step={step}; {err or 'state equal'}")

    # for the cross-framework test (dist/cross_worker.py): a DDP checkpoint and its state
    acc.project_configuration.automatic_checkpoint_naming = False
    acc.save_state(os.path.join(OUT, "cross"))
    torch.save(snapshot(model, opt), os.path.join(OUT, f"cross-{rank}.pt"))

    several_models(acc)
    fsdp2(acc)
    acc.end_training()


def several_models(acc: Accelerator) -> None:
    acc.free_memory()
    acc._custom_objects.clear()
    acc.project_configuration.automatic_checkpoint_naming = False
    torch.manual_seed(5)
    a, b = nn.Linear(3, 2), nn.Linear(2, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(b.parameters())
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    for _ in range(2):
        loss = b(a(torch.randn(5, 3))).pow(2).mean()
        acc.backward(loss)
        oa.step()
        ob.step()
    root = os.path.join(OUT, "several")
    acc.save_state(root)
    want = [snapshot(a, oa), snapshot(b, ob)]
    with torch.no_grad():
        for p in [*a.parameters(), *b.parameters()]:
            p.zero_()
    acc.load_state(root)
    errs = [e for e in (state_diff(snapshot(m, o), w) for (m, o), w in zip([(a, oa), (b, ob)], want)) if e]
    with CheckpointManager(root) as mgr:
        keys = set(mgr.manifest().leaves)
    expected = {"model/0.weight", "model/1.bias", "optim/0/state/0.weight/momentum_buffer", "optim/1/state/1.bias/exp_avg",
                "progress/accelerate/iteration", "progress/accelerate/step"}
    check("several_models_roundtrip", not any(errs) and expected <= keys, f"{errs} {sorted(keys)[:12]}")


def fsdp2(acc: Accelerator) -> None:
    from torch.distributed.fsdp import fully_shard

    acc.free_memory()
    torch.manual_seed(11)
    m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(m[0])
    fully_shard(m)
    m = acc.prepare_model(m, evaluation_mode=True)  # already sharded: no DDP around it
    opt = acc.prepare(torch.optim.AdamW(m.parameters(), lr=1e-2))
    dl = acc.prepare(DataLoader(dataset(), batch_size=4, shuffle=True))
    it = iter(dl)

    def steps(n: int) -> list[torch.Tensor]:
        out = []
        for _ in range(n):
            _, x, y = next(it)
            loss = ((m(x) - y) ** 2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(loss.detach().clone())
        return out

    def full() -> dict:
        return {k: v.full_tensor().clone() for k, v in m.state_dict().items()}

    steps(3)
    root = os.path.join(OUT, "fsdp2")
    acc.save_state(root)
    want = full()
    first = steps(3)
    acc.load_state(root)
    checks.same("fsdp2_params_bit_exact_after_load", full(), want)
    it = iter(dl)  # the restored position: batch 3 of epoch 0
    again = steps(3)
    check("fsdp2_next_losses_bit_exact", all(torch.equal(a, b) for a, b in zip(first, again)),
          f"{first} vs {again}")
    with CheckpointManager(root) as mgr:
        leaves = mgr.manifest().leaves
        shape = list(leaves["model/0.weight"].shape)
    check("fsdp2_saved_global_shapes", shape == [16, 4], str(shape))


if __name__ == "__main__":
    checks.guard("whole run", main)
    checks.write(os.path.join(OUT, f"{MODE}-rank{checks.rank}.json"))
