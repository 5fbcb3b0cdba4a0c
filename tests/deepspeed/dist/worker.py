"""Real DeepSpeed engines on gloo/CPU: many save/restore cases per launch (a launch costs ~8 s).

    worker.py save ROOT      (world size 2) train every case, save, record references
    worker.py restore ROOT   (any world size) restore every case into every target, check

Results: ROOT/results/<phase>-w<world>-r<rank>.json, the checks (``tests.checks.Checks``).
``SK_CASES=hook``: only the cases saved through the hook (and the hook's options), restored at
the saver's stage. ``SK_WRITER=process``: the hook's managers write with ``writer="process"``
(from the DeepSpeed config's section, and ``attach``'s arguments), each such save checks that
persist processes wrote it and notes their pids in ROOT/persist-pids-r<rank>.
References (rank 0, saved engine): ROOT/refs/<case>.safetensors (full fp32 params and Adam
moments from DeepSpeed's own safe_get_full_*), ROOT/refs/<case>.json (losses of the steps
after the save, uninterrupted).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import deepspeed  # noqa: E402  (after torch, as DeepSpeed expects)

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from shardkeeper.core import CheckpointManager, CommitConflictError, StateMismatchError  # noqa: E402
from shardkeeper.core.adapter.registry import load_adapter  # noqa: E402
from tests.checks import Checks, state_diff  # noqa: E402
from tests.persist_probe import note_persist_processes  # noqa: E402

from deepspeed.accelerator import get_accelerator  # noqa: E402

# DeepSpeed's CPU accelerator refuses fp16 engines unless oneDNN has fast fp16 kernels for this
# CPU (AVX512-FP16/AMX-FP16); torch's generic CPU half kernels run everywhere, so the matrix
# answers the probe itself and keeps its fp16 engines on every CPU. Recorded in the results.
FP16_PROBE = bool(get_accelerator().is_fp16_supported())
if not FP16_PROBE:
    get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]

skds = load_adapter("deepspeed")  # the entry point, as the other adapters find it
from shardkeeper.deepspeed._ds_internals import loss_scaler_state  # noqa: E402

# DeepSpeed 0.18.9's ZeRO-3 fp16 on CPU gave a run-to-run loss difference in the uninterrupted
# run when a background write overlapped its steps (the writer only reads host copies staged
# before save() returned); the matrix saves synchronously there, asynchronously from 0.19.
ASYNC = tuple(int(x) for x in deepspeed.__version__.split(".")[:2]) >= (0, 19)
SAVE_STEPS = 3
MORE_STEPS = 2
MOMENTS = ("exp_avg", "exp_avg_sq")
# (stage, dtype); "hook" cases save through engine.save_checkpoint after attach()
SAVED = [(s, d) for d in ("fp32", "bf16", "fp16") for s in (1, 2, 3)]
HOOK_CASES = {(2, "bf16"), (3, "fp32")}
# also saved in DeepSpeed's native format, imported by the test (import_native_checkpoint)
NATIVE_CASES = {(2, "fp32"), (3, "bf16")}
# saved with staging="overlap": the inner optimizer's step waits for the background copy
OVERLAP_CASES = {(1, "bf16"), (3, "fp16")}
HOOKS_ONLY = os.environ.get("SK_CASES") == "hook"
WRITER = os.environ.get("SK_WRITER", "thread")  # the hook's writer option: "thread" or "process"


def note_writer(res: Checks, what: str, root: Path, ckpt: str, hook) -> None:
    """With the process writer: the hook's saves under ``ckpt`` went through persist processes."""
    if WRITER == "process":
        pids = root / f"persist-pids-r{dist.get_rank()}"
        note_persist_processes(res, what, hook.manager(ckpt).options, pids)


class Net(torch.nn.Module):
    """Parameter sizes 35, 5, 15, 3: none divisible by 2 or 3 except by chance; a buffer too."""

    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, hidden)
        self.out = torch.nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.tensor([1.5]))
        self.shift = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3), requires_grad=False)  # frozen

    def trainable(self):
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.scale.to(x.dtype) + self.shift.to(x.dtype)


def case_name(stage: int, dtype: str) -> str:
    return f"z{stage}-{dtype}"


def make_engine(stage: int, dtype: str, seed: int, hidden: int = 5, extra: dict | None = None):
    torch.manual_seed(seed)
    model = Net(hidden)
    if seed:  # restore targets: the frozen parameter differs from the saved one until restored
        model.shift.data.mul_(2.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        # a dynamic loss scale that moves within the run: its state must come back too
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8, "loss_scale_window": 2},
        "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={**cfg, **(extra or {})})
    return engine


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 7, generator=g).to(dtype), torch.randn(4, 3, generator=g)


def train_step(engine, step: int) -> float:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    x, y = batch(step, dist.get_rank(), dtype)
    loss = (engine(x).float() - y).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def full_state(engine) -> dict[str, torch.Tensor]:
    """DeepSpeed's own view: full fp32 params and moments (collectives: every rank calls)."""
    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[f"param/{n}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for k in MOMENTS:
            out[f"{k}/{n}"] = safe_get_full_optimizer_state(p, k).detach().clone().contiguous()
    return out


def lp_matches_master(engine) -> list[str]:
    """Low-precision module weights must equal the fp32 masters cast down (after a restore),
    and the frozen parameter the saved one."""
    bad = []
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                if not torch.equal(p.detach().float(), torch.linspace(-1.0, 1.0, 3)):
                    bad.append(n)
            continue
        master = safe_get_full_fp32_param(p)
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            lp = p.detach().clone()
        if not torch.equal(lp, master.to(lp.dtype).view_as(lp)):
            bad.append(n)
    return bad


def compare(res: Checks, case: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Every fp32 master and Adam moment of Net's four trainable parameters (12 tensors), bit for bit."""
    if len(ref) != 12:
        res.check(case, False, f"the reference holds {len(ref)} tensors, not Net's 12: {sorted(ref)}")
    else:
        res.same(case, got, ref)


# -- save phase ----------------------------------------------------------------------------
def save_case(root: Path, res: Checks, stage: int, dtype: str) -> None:
    name = case_name(stage, dtype)
    # the hook's settings may live in the DeepSpeed config
    extra = {"shardkeeper": {"keep_last": 2, "writer": WRITER}} if (stage, dtype) in HOOK_CASES else None
    engine = make_engine(stage, dtype, seed=0, extra=extra)
    for k in range(SAVE_STEPS):
        train_step(engine, k)
    ckpt = root / "ckpt" / name
    if (stage, dtype) in HOOK_CASES:
        hook = skds.attach(engine)  # the directory passed to save_checkpoint is the root
        res.check(f"{name}: hook settings from the DeepSpeed config",
                  hook.manager(str(ckpt)).retention.keep_last == 2)
        engine.save_checkpoint(str(ckpt), tag=f"global_step{SAVE_STEPS}",
                               client_state={"iteration": SAVE_STEPS, "note": name, "t": torch.arange(3.0)})
    else:
        overlap = (stage, dtype) in OVERLAP_CASES and ASYNC
        # ZeRO partitions recorded by the flat-partition rule (format.md 3.8), not per chunk
        mgr = CheckpointManager(str(ckpt), staging="overlap" if overlap else "blocking", describe_layouts=True)
        handle = mgr.save(SAVE_STEPS, skds.engine_state(engine), async_save=ASYNC)  # training goes on
        if overlap:
            res.check(f"{name}: overlap deferred the copy of the optimizer's tensors", handle.deferred_bytes > 0)
        if (stage, dtype) in NATIVE_CASES:
            engine.save_checkpoint(str(root / "native" / name), tag=f"global_step{SAVE_STEPS}",
                                   client_state={"iteration": SAVE_STEPS})
    ref = full_state(engine)
    scaler = loss_scaler_state(engine)
    losses = [train_step(engine, SAVE_STEPS + k) for k in range(MORE_STEPS)]  # mutates while writing
    if (stage, dtype) in HOOK_CASES:
        hook.wait()
        note_writer(res, name, root, str(ckpt), hook)
        res.check(f"{name}: the hook wrote no DeepSpeed files", not any(ckpt.glob("global_step*")) and not (ckpt / "latest").exists())
        hook.detach()
    else:
        handle.wait()
        mgr.close()
    res.check(f"{name}: committed", (ckpt / f"step-{SAVE_STEPS:012d}" / "manifest.json").exists())
    if (stage, dtype) not in HOOK_CASES:
        man = json.loads((ckpt / f"step-{SAVE_STEPS:012d}" / "manifest.json").read_text())
        described = man.get("described", {}).get("keys", [])
        trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
        model = [k for k in described if k.startswith("model/")]
        moments = [k for k in described if k.startswith("optim/state/")]
        res.check(f"{name}: every master weight and moment described by its partition",
                  len(model) == trainable and len(moments) == 2 * trainable and len(described) == 3 * trainable,
                  f"{len(model)} weights, {len(moments)} moments of {trainable} trainable parameters")
    losses_all = [None] * dist.get_world_size()
    dist.all_gather_object(losses_all, losses)
    if dist.get_rank() == 0:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        save_file(ref, str(root / "refs" / f"{name}.safetensors"))
        meta = {"losses": losses_all, "global_samples": SAVE_STEPS * 4 * dist.get_world_size(), "scaler": scaler}
        (root / "refs" / f"{name}.json").write_text(json.dumps(meta))
    engine.destroy()


def save_plain(root: Path, res: Checks) -> None:
    """A plain torch model + Adam, saved by the core (replicated on both ranks)."""
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    for k in range(SAVE_STEPS):
        x, y = batch(k, 0)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with CheckpointManager(str(root / "ckpt" / "plain")) as mgr:
        mgr.save(SAVE_STEPS, {"model": model, "optim": opt}, async_save=False)
    ref = {}
    for n, p in model.trainable():
        ref[f"param/{n}"] = p.detach().clone()
        for k in MOMENTS:
            ref[f"{k}/{n}"] = opt.state[p][k].clone()
    if dist.get_rank() == 0:
        save_file(ref, str(root / "refs" / "plain.safetensors"))
    res.check("plain: saved", True)


def _fsdp2(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


def _fsdp2_full(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[f"param/{n}"] = p.full_tensor().detach().clone()
        for k in MOMENTS:
            out[f"{k}/{n}"] = opt.state[p][k].full_tensor().clone()
    return out


def save_fsdp2(root: Path, res: Checks) -> None:
    """An FSDP2 model + Adam (DTensor shards), saved by the core at world size 2."""
    model, opt = _fsdp2(seed=11)
    for k in range(SAVE_STEPS):
        x, y = batch(k, dist.get_rank())
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with CheckpointManager(str(root / "ckpt" / "fsdp2")) as mgr:
        mgr.save(SAVE_STEPS, {"model": model, "optim": opt}, async_save=False)
    ref = _fsdp2_full(model, opt)
    if dist.get_rank() == 0:
        save_file(ref, str(root / "refs" / "fsdp2.safetensors"))
    res.check("fsdp2: saved", True)


# -- restore phase -------------------------------------------------------------------------
def restore_case(root: Path, res: Checks, stage: int, dtype: str, target_stage: int) -> None:
    name = case_name(stage, dtype)
    w = dist.get_world_size()
    case = f"{name}-w2 -> z{target_stage}-{dtype}-w{w}"
    ref = load_file(str(root / "refs" / f"{name}.safetensors"))
    engine = make_engine(target_stage, dtype, seed=1)  # other initial weights: restore must overwrite
    ckpt = str(root / "ckpt" / name)
    if (stage, dtype) in HOOK_CASES:
        hook = skds.attach(engine, ckpt)
        path, client = engine.load_checkpoint("ignored-when-a-root-is-attached", tag=f"global_step{SAVE_STEPS}")
        res.check(f"{case}: load_checkpoint returns (path, client_state)",
                  path is not None and client["iteration"] == SAVE_STEPS and client["note"] == name
                  and torch.equal(client["t"], torch.arange(3.0)), f"{path} {client}")
        hook.detach()
    else:
        with CheckpointManager(ckpt) as mgr:
            step = mgr.restore(skds.engine_state(engine))
        res.check(f"{case}: restored step", step == SAVE_STEPS, str(step))
    meta = json.loads((root / "refs" / f"{name}.json").read_text())
    res.check(f"{case}: progress", engine.global_steps == SAVE_STEPS and engine.global_samples == meta["global_samples"],
              f"{engine.global_steps} {engine.global_samples}")
    res.check(f"{case}: loss scaler", loss_scaler_state(engine) == meta["scaler"], f"{loss_scaler_state(engine)} vs {meta['scaler']}")
    res.check(f"{case}: scheduler", engine.lr_scheduler.last_batch_iteration == SAVE_STEPS - 1,
              str(engine.lr_scheduler.last_batch_iteration))
    compare(res, f"{case}: fp32 masters and Adam moments bit-exact vs safe_get_full_*", full_state(engine), ref)
    bad = lp_matches_master(engine)
    res.check(f"{case}: low-precision weights = masters cast down", not bad, str(bad))
    base = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in base.state.values()}
    res.check(f"{case}: Adam step", steps == {float(SAVE_STEPS)}, str(steps))
    if w == 2 and target_stage == stage:
        want = meta["losses"][dist.get_rank()]
        got = [train_step(engine, SAVE_STEPS + k) for k in range(MORE_STEPS)]
        res.check(f"{case}: next losses bit-exact vs uninterrupted", got == want, f"{got} vs {want}")
    engine.destroy()


def imported_into_engine(root: Path, res: Checks, stage: int, dtype: str, target_stage: int) -> None:
    """A native DeepSpeed checkpoint, imported by the test, restores like a shardkeeper one."""
    name = case_name(stage, dtype)
    case = f"imported-{name}-w2 -> z{target_stage}-{dtype}-w{dist.get_world_size()}"
    engine = make_engine(target_stage, dtype, seed=1)
    with CheckpointManager(str(root / "ckpt" / f"imported-{name}")) as mgr:
        mgr.restore({**skds.engine_state(engine), "extra": {"client_state": {"iteration": None}}})
    compare(res, f"{case}: fp32 masters and Adam moments bit-exact", full_state(engine), load_file(str(root / "refs" / f"{name}.safetensors")))
    meta = json.loads((root / "refs" / f"{name}.json").read_text())
    res.check(f"{case}: progress and scheduler",
              engine.global_steps == SAVE_STEPS and engine.global_samples == meta["global_samples"]
              and engine.lr_scheduler.last_batch_iteration == SAVE_STEPS - 1)
    res.check(f"{case}: low-precision weights = masters", not lp_matches_master(engine))
    engine.destroy()


def versus_universal(root: Path, res: Checks, stage: int, dtype: str) -> None:
    """World-size change: shardkeeper's online resume equals DeepSpeed's own universal-checkpoint
    resume (converted offline by ds_to_universal) in state and in the next losses, bit for bit."""
    name = case_name(stage, dtype)
    case = f"{name}-w2 -> z{stage}-{dtype}-w{dist.get_world_size()} vs DeepSpeed universal"
    ours = make_engine(stage, dtype, seed=1)
    with CheckpointManager(str(root / "ckpt" / name)) as mgr:
        mgr.restore(skds.engine_state(ours))
    ours_state = full_state(ours)
    ours_losses = [train_step(ours, SAVE_STEPS + k) for k in range(MORE_STEPS)]
    ours.destroy()
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}},
        "checkpoint": {"load_universal": True},
    }
    theirs, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    theirs.load_checkpoint(str(root / "universal"), tag=name)
    compare(res, f"{case}: state equal", full_state(theirs), ours_state)
    theirs_losses = [train_step(theirs, SAVE_STEPS + k) for k in range(MORE_STEPS)]
    res.check(f"{case}: next losses equal", theirs_losses == ours_losses, f"{ours_losses} vs {theirs_losses}")
    theirs.destroy()


def fsdp2_cross(root: Path, res: Checks, stage: int) -> None:
    """FSDP2 -> ZeRO engine (stage 2), and ZeRO-3 (bf16) -> FSDP2, at this world size, bit for bit."""
    w = dist.get_world_size()
    case = f"fsdp2-w2 -> z{stage}-fp32-w{w}"
    engine = make_engine(stage, "fp32", seed=1)
    with CheckpointManager(str(root / "ckpt" / "fsdp2")) as mgr:
        mgr.restore(skds.engine_state(engine), only=["model/*", "optim/*"])
    compare(res, f"{case}: params and moments bit-exact", full_state(engine), load_file(str(root / "refs" / "fsdp2.safetensors")))
    engine.destroy()
    case = f"z3-bf16-w2 -> fsdp2-w{w}"
    model, opt = _fsdp2(seed=12)
    with CheckpointManager(str(root / "ckpt" / "z3-bf16")) as mgr:
        mgr.restore({"model": model, "optim": opt}, only=["model/*", "optim/*"])
    compare(res, f"{case}: params and moments bit-exact", _fsdp2_full(model, opt), load_file(str(root / "refs" / "z3-bf16.safetensors")))


def plain_into_engine(root: Path, res: Checks, target_stage: int) -> None:
    """A core-written plain torch checkpoint restores into a ZeRO engine."""
    case = f"plain-w2 -> z{target_stage}-fp32-w{dist.get_world_size()}"
    engine = make_engine(target_stage, "fp32", seed=1)
    with CheckpointManager(str(root / "ckpt" / "plain")) as mgr:
        mgr.restore(skds.engine_state(engine), only=["model/*", "optim/*"])
    compare(res, f"{case}: params and moments bit-exact", full_state(engine), load_file(str(root / "refs" / "plain.safetensors")))
    res.check(f"{case}: low-precision weights = masters", not lp_matches_master(engine))
    engine.destroy()


def engine_into_plain(root: Path, res: Checks, stage: int, dtype: str) -> None:
    """A ZeRO checkpoint restores into a plain torch model + Adam (fp32 masters)."""
    name = case_name(stage, dtype)
    case = f"{name}-w2 -> plain-w{dist.get_world_size()}"
    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    with CheckpointManager(str(root / "ckpt" / name)) as mgr:
        mgr.restore({"model": model, "optim": opt}, only=["model/*", "optim/*"])
    got = {}
    for n, p in model.trainable():
        got[f"param/{n}"] = p.detach()
        for k in MOMENTS:
            got[f"{k}/{n}"] = opt.state[p][k]
    compare(res, f"{case}: params and moments bit-exact", got, load_file(str(root / "refs" / f"{name}.safetensors")))
    steps = {float(s["step"]) for s in opt.state.values()}
    res.check(f"{case}: Adam step", steps == {float(SAVE_STEPS)}, str(steps))


def mismatch(root: Path, res: Checks, stage: int, dtype: str) -> None:
    """A checkpoint whose parameter shapes differ from the engine's: one error listing them."""
    case = f"mismatch-w{dist.get_world_size()}"
    engine = make_engine(stage, dtype, seed=1, hidden=6)
    hook = skds.attach(engine, str(root / "ckpt" / case_name(stage, dtype)))
    try:
        engine.load_checkpoint(None)
    except StateMismatchError as e:
        msg = str(e)
        want = ["inp.weight", "[5, 7]", "[6, 7]", "out.weight", "inp.bias", "step 3", "rank"]
        res.check(f"{case}: clear error listing every mismatch", all(s in msg for s in want), msg)
    else:
        res.check(f"{case}: clear error listing every mismatch", False, "no error raised")
    try:
        engine.load_checkpoint(None, tag="global_step99")
    except FileNotFoundError as e:
        res.check(f"{case}: unknown tag", "global_step99" in str(e), str(e))
    else:
        res.check(f"{case}: unknown tag", False, "no error raised")
    hook.detach()
    engine.destroy()


def hook_options(root: Path, res: Checks, stage: int, dtype: str) -> None:
    """load_checkpoint's options map onto partial restores; an empty root gives (None, None)."""
    w = dist.get_world_size()
    case = f"hook-options-w{w}"
    name = case_name(stage, dtype)
    ref = load_file(str(root / "refs" / f"{name}.safetensors"))
    engine = make_engine(stage, dtype, seed=1)
    hook = skds.attach(engine, str(root / "ckpt" / name))
    path, client = engine.load_checkpoint(None, load_module_only=True)
    got = full_state(engine)
    params = state_diff(got, {k: v for k, v in ref.items() if k.startswith("param/")}, subset=True)
    fresh = all(not got[k].any() for k in got if not k.startswith("param/"))
    res.check(f"{case}: load_module_only restores weights only",
              not params and fresh and engine.global_steps == 0 and client.get("iteration") == SAVE_STEPS,
              f"params: {params or 'equal'}; moments zero: {fresh}; global_steps {engine.global_steps}; "
              f"client {client}")
    path, client = engine.load_checkpoint(None, load_optimizer_states=False)
    got = full_state(engine)
    fresh = all(not got[k].any() for k in got if not k.startswith("param/"))
    res.check(f"{case}: load_optimizer_states=False keeps the optimizer", fresh and engine.global_steps == SAVE_STEPS
              and client["iteration"] == SAVE_STEPS, f"{fresh} {engine.global_steps} {client}")
    hook.detach()
    hook = skds.attach(engine, str(root / f"named-w{w}"), async_save=False, writer=WRITER)
    engine.save_checkpoint(None, tag="best", client_state={"k": [1, 2]})  # at global_steps (3)
    note_writer(res, case, root, str(root / f"named-w{w}"), hook)
    path, client = engine.load_checkpoint(None, tag="best")
    res.check(f"{case}: a named tag saves at global_steps and loads by name",
              path.endswith(f"step-{SAVE_STEPS:012d}") and client == {"k": [1, 2]}, f"{path} {client}")
    try:
        engine.save_checkpoint(None, tag="global_step3")
    except CommitConflictError as e:
        res.check(f"{case}: saving a committed step again is refused", "already committed" in str(e), str(e))
    else:
        res.check(f"{case}: saving a committed step again is refused", False, "no error")
    try:  # a numeric tag of another count than global_steps: the next saves would fall below it
        engine.save_checkpoint(None, tag=100)
    except ValueError as e:
        res.check(f"{case}: a numeric tag other than global_steps is refused", "global step 3" in str(e)
                  and "tag=None" in str(e) and not hook.manager(None).is_committed(100), str(e))
    else:
        res.check(f"{case}: a numeric tag other than global_steps is refused", False, "saved as step 100")
    hook.detach()
    hook = skds.attach(engine, str(root / f"empty-w{w}"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.load_checkpoint(None)
    res.check(f"{case}: nothing committed -> (None, None) and a warning",
              out == (None, None) and any("no committed checkpoint" in str(x.message) for x in caught), str(out))
    hook.detach()
    engine.destroy()


def contract(res: Checks, stage: int, broken: dict[str, str]) -> None:
    """The private DeepSpeed internals the adapter uses: present, on a tested release. Then
    one plain DeepSpeed training step (no shardkeeper code): a stage DeepSpeed itself cannot
    train with this torch is recorded in ``broken`` and left out of the matrix."""
    from shardkeeper.deepspeed import _ds_internals as dsi

    engine = make_engine(stage, "fp32", seed=0)
    missing = dsi.check_engine(engine)
    res.check(f"internals z{stage}: present (a new DeepSpeed release changed them if not)", not missing, str(missing))
    res.check(f"internals z{stage}: DeepSpeed {deepspeed.__version__} within TESTED_RANGE {dsi.TESTED_RANGE}",
              dsi.version_tested())
    try:
        train_step(engine, 0)
    except Exception:
        broken[str(stage)] = traceback.format_exc()[-3000:]
    engine.destroy()


def working_stages(root: Path) -> list[int]:
    return json.loads((root / "stages.json").read_text())["working"]


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    if "RANK" not in os.environ:  # one process without torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    res = Checks(root / "results" / f"{phase}-w{dist.get_world_size()}-r{dist.get_rank()}.json")
    try:
        if phase == "save":
            broken: dict[str, str] = {}
            # ZeRO-3 first: a stage DeepSpeed fails to train may leave its process group state
            # dirty (seen on 0.18.9), which must not reach the cases that do run.
            for stage in (3, 1, 2):
                res.guard(f"internals z{stage}", lambda s=stage: contract(res, s, broken))
                if str(stage) in broken:
                    continue
                for s_, dtype in SAVED:
                    if s_ == stage and (not HOOKS_ONLY or (s_, dtype) in HOOK_CASES):
                        res.guard(f"save {case_name(stage, dtype)}",
                                  lambda s=stage, d=dtype: save_case(root, res, s, d))
            working = [s for s in (1, 2, 3) if str(s) not in broken]
            if dist.get_rank() == 0:
                (root / "stages.json").write_text(json.dumps({"working": working, "broken": broken, "fp16_probe": FP16_PROBE}))
            if not HOOKS_ONLY:
                res.guard("save plain", lambda: save_plain(root, res))
                res.guard("save fsdp2", lambda: save_fsdp2(root, res))
        elif HOOKS_ONLY:
            W = working_stages(root)
            for stage, dtype in sorted(HOOK_CASES):
                if stage in W:
                    res.guard(f"restore {case_name(stage, dtype)} -> z{stage}",
                              lambda s=stage, d=dtype: restore_case(root, res, s, d, s))
            res.guard("hook options", lambda: hook_options(root, res, *((2, "bf16") if 2 in W else (3, "fp32"))))
        else:
            W = working_stages(root)
            hook_case = (2, "bf16") if 2 in W else (3, "fp32")
            for stage, dtype in SAVED:
                if stage not in W:
                    continue
                for t in W:
                    res.guard(f"restore {case_name(stage, dtype)} -> z{t}",
                              lambda s=stage, d=dtype, t=t: restore_case(root, res, s, d, t))
            for t in (1, 3):
                if t in W:
                    res.guard(f"plain -> z{t}", lambda t=t: plain_into_engine(root, res, t))
            for stage, dtype in ((3, "fp32"), (3, "bf16"), (1, "fp32")):
                if stage in W:
                    res.guard(f"{case_name(stage, dtype)} -> plain",
                              lambda s=stage, d=dtype: engine_into_plain(root, res, s, d))
            for stage, dtype in sorted(NATIVE_CASES):
                for t in (1, 3):
                    if stage in W and t in W:
                        res.guard(f"imported {case_name(stage, dtype)} -> z{t}",
                                lambda s=stage, d=dtype, t=t: imported_into_engine(root, res, s, d, t))
            if dist.get_world_size() != 2 and 2 in W:
                res.guard("versus universal", lambda: versus_universal(root, res, 2, "fp32"))
            if 3 in W:
                res.guard("fsdp2", lambda: fsdp2_cross(root, res, 2 if 2 in W else 3))
            res.guard("mismatch", lambda: mismatch(root, res, *hook_case))
            res.guard("hook options", lambda: hook_options(root, res, *hook_case))
    finally:
        res.write()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
