"""Multi-process Lightning runs for tests/lightning/test_strategies.py (launched by torchrun).

``worker.py train DIR``: for each strategy (ddp, ModelParallel FSDP2 dp=2, ModelParallel TP
tp=2) an uninterrupted 4-epoch fit that saves through ModelCheckpoint (every epoch, last) and
``trainer.save_checkpoint`` (end of epoch 0), with torch.save / DCP saves spied on; writes
the reference state (final and at the end of epoch 1) and the losses.

``worker.py resume DIR``: for each strategy, two fresh Trainers in this new process resume
(from ModelCheckpoint's epoch-1 file and from the manual epoch-0 file) and train to the end;
parameters, optimizer state, scheduler, callback states, global_step and every later loss
are compared bit for bit with the uninterrupted run.

``worker.py cross DIR`` (one process): the FSDP2 checkpoint resumes under ddp at world size
1; a checkpoint written by the core directly resumes in a Trainer; a Lightning .ckpt and a
Lightning sharded directory (stock ModelParallel, written at the end of ``train``) are imported.

``SK_STRATEGIES=ddp,...``: those strategies only. ``SK_WRITER=process``: the plugins write with
``writer="process"``; after each fit every rank checks that persist processes served its saves
and notes their pids in ``DIR/persist-pids-r<rank>``.

Rank 0 writes its checks (``tests.checks.Checks``) to ``DIR/<phase>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # before any engine is built

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from shardkeeper.lightning import ShardkeeperCheckpointIO  # noqa: E402
from shardkeeper.core.format.pointer import looks_like_pointer  # noqa: E402
from tests.checks import Checks, deepspeed_full_state  # noqa: E402
from tests.persist_probe import note_persist_processes  # noqa: E402
from tests.lightning.common import (  # noqa: E402
    Net,
    cpu_deepspeed_strategy,
    cpu_fsdp1_strategy,
    full_state,
    loader,
)

EPOCHS = 4
STRATEGIES = tuple(os.environ.get("SK_STRATEGIES", "ddp,fsdp2,tp,fsdp1,ds2,ds3").split(","))  # a subset: debugging
WRITER = os.environ.get("SK_WRITER", "thread")  # the plugin's writer option: "thread" or "process"
MODE = {"ddp": "none", "fsdp1": "none", "ds2": "none", "ds3": "none"}
checks = Checks()
check = checks.check


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def make_strategy(name: str, world: int) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if name == "ddp":
        return "ddp"
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if name == "tp":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    if name == "fsdp1":
        return cpu_fsdp1_strategy()
    if name in ("ds2", "ds3"):
        return cpu_deepspeed_strategy(int(name[2]))
    raise ValueError(name)


def state_of(trainer: L.Trainer, lm: Any) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments by FQN: full tensors (DeepSpeed: through its own API),
    this rank's shard for FSDP1 (compared per rank)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        return deepspeed_full_state(trainer.strategy.deepspeed_engine)
    if isinstance(trainer.strategy, FSDPStrategy):
        return full_state(trainer.strategy.model, trainer.optimizers[0], full=False)
    return full_state(lm, trainer.optimizers[0])


def trainer(strategy: Any, plugin: Any, ckdir: str, world: int, extra: list[Any] | None = None, epochs: int = EPOCHS) -> L.Trainer:
    cbs = [*(extra or []), EarlyStopping("train_loss", patience=100),
           ModelCheckpoint(dirpath=ckdir, every_n_epochs=1, save_top_k=-1, save_last=True)]
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=world, strategy=strategy, plugins=[plugin],
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=cbs,
        deterministic=True,
    )


class Recorder(Callback):
    """A stateful callback: counts epochs (restored on resume), saves manually at the end of
    epoch 0, writes the reference state at the end of epochs 0 and 1, and records at every
    save what was saved of the callback states (EarlyStopping's and its own)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.epochs = 0
        self.saves: dict[str, list[Any]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epochs = sd["epochs"]

    @property
    def state_key(self) -> str:
        return "Recorder"  # it restores the Recorder's saved state

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.epochs += 1
        e = trainer.current_epoch
        if e == 0:
            trainer.save_checkpoint(f"{self.out}/ck/manual-epoch0.ckpt")
        st = state_of(trainer, pl_module)
        if e in (0, 1):
            save_file({k: v.contiguous() for k, v in st.items()}, f"{self.out}/ref-epoch{e}-r{rank()}.safetensors")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saves.setdefault(str(trainer.global_step), []).append({"es": es_state(trainer), "epochs": self.epochs})


def es_state(trainer: L.Trainer) -> dict[str, Any]:
    es = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
    return {"wait_count": es.wait_count, "best_score": float(es.best_score)}


def spy() -> dict[str, int]:
    """Count torch.save and DCP saves from here on (none may happen: the plugin writes)."""
    import torch.distributed.checkpoint as dcp
    import lightning.fabric.strategies.fsdp as lf_fsdp
    import lightning.fabric.strategies.model_parallel as lf_mp
    import lightning.pytorch.strategies.fsdp as lp_fsdp
    import lightning.pytorch.strategies.model_parallel as lp_mp

    counts = {"torch.save": 0, "dcp.save": 0}

    def wrap(mod: Any, attr: str, key: str) -> None:
        orig = getattr(mod, attr)

        def f(*a: Any, **k: Any) -> Any:
            import io

            dest = a[1] if len(a) > 1 else k.get("f", k.get("checkpoint_id"))
            if key != "torch.save" or not isinstance(dest, io.BytesIO):  # object collectives pickle in memory
                counts[key] += 1
            return orig(*a, **k)

        setattr(mod, attr, f)

    wrap(torch, "save", "torch.save")
    wrap(dcp, "save", "dcp.save")
    for m in (lf_fsdp, lf_mp, lp_fsdp, lp_mp):  # each module holds its own reference
        if hasattr(m, "_distributed_checkpoint_save"):
            wrap(m, "_distributed_checkpoint_save", "dcp.save")
    return counts


def phase_train(d: str, world: int) -> None:
    counts = spy()
    for name in STRATEGIES:
        out = f"{d}/{name}"
        os.makedirs(out, exist_ok=True)
        L.seed_everything(0)
        net = Net(mode=MODE.get(name, name))
        rec = Recorder(out)
        plugin = ShardkeeperCheckpointIO(f"{out}/root", writer=WRITER)
        t = trainer(make_strategy(name, world), plugin, f"{out}/ck", world, [rec])
        t.fit(net, loader())
        if WRITER == "process":
            note_persist_processes(checks, f"{name} train", plugin.manager().options, f"{d}/persist-pids-r{rank()}")
        st = state_of(t, net)
        save_file({k: v.contiguous() for k, v in st.items()}, f"{out}/ref-final-r{rank()}.safetensors")
        if rank() == 0:
            meta = {
                "losses": net.losses, "global_step": t.global_step, "saves": rec.saves,
                "sched": t.lr_scheduler_configs[0].scheduler.state_dict(),
                "steps": plugin.steps(),
            }
            with open(f"{out}/ref.json", "w") as f:
                json.dump(meta, f)
            files = sorted(os.listdir(f"{out}/ck"))
            check(f"{name}: ModelCheckpoint and save_checkpoint wrote pointers", "last.ckpt" in files and "manual-epoch0.ckpt" in files, files)
            sizes = {f: os.path.getsize(f"{out}/ck/{f}") for f in files}
            pointers = {f: os.path.isfile(f"{out}/ck/{f}") and looks_like_pointer(open(f"{out}/ck/{f}", "rb").read()) for f in files}
            check(f"{name}: only small pointer files beside the root (no strategy checkpoint)",
                  all(pointers.values()) and all(s < 16384 for s in sizes.values()), (sizes, pointers))
            check(f"{name}: one committed step per epoch", meta["steps"] == [t.global_step * (e + 1) // EPOCHS for e in range(EPOCHS)], meta["steps"])
        # Lightning removes a path on every rank (ModelCheckpoint's top-k): the step it named
        # goes through the core's collective delete; the steps still named stay.
        doomed = t.strategy.broadcast(f"{out}/ck/epoch=2-step={meta['steps'][2]}.ckpt" if rank() == 0 else None)
        t.strategy.remove_checkpoint(doomed)
        if rank() == 0:
            left = plugin.steps()
            want = [s for s in meta["steps"] if s != meta["steps"][2]]
            check(f"{name}: removing a path deletes its step on every rank (collective)", left == want and not os.path.exists(doomed), left)
    check("no torch.save and no DCP save by any strategy", counts == {"torch.save": 0, "dcp.save": 0}, counts)
    if "fsdp2" in STRATEGIES:  # for phase cross (the FSDP2 checkpoint's import)
        stock_sharded_save(d, world)


def stock_sharded_save(d: str, world: int) -> None:
    """Lightning's own sharded checkpoint (no plugin): ModelParallel FSDP2 at dp=2, one epoch,
    ``trainer.save_checkpoint`` -> a DCP directory + meta.pt; the full state beside it."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    out = f"{d}/stock-sharded"
    L.seed_everything(0)
    net = Net(mode="fsdp2")
    t = L.Trainer(max_epochs=1, accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                  logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  callbacks=[EarlyStopping("train_loss", patience=100)], deterministic=True, default_root_dir=out)
    t.fit(net, loader())
    t.save_checkpoint(f"{out}/sharded.ckpt")
    st = state_of(t, net)
    if rank() == 0:
        save_file({k: v.contiguous() for k, v in st.items()}, f"{out}/ref.safetensors")
        files = sorted(os.listdir(f"{out}/sharded.ckpt"))
        check("stock ModelParallel wrote a sharded directory (DCP + meta.pt)", ".metadata" in files and "meta.pt" in files
              and sum(f.endswith(".distcp") for f in files) == world, files)


def compare(name: str, label: str, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    checks.same(f"{name} {label}: {len(ref)} parameter/optimizer tensors bit for bit", got, ref)


class AtStart(Recorder):
    """Records, when training starts after a resume, what the resume restored."""

    def __init__(self) -> None:
        super().__init__("")
        self.seen: dict[str, Any] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.epochs += 1

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen = {
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "es": es_state(trainer),
            "epochs": self.epochs,
            "state": state_of(trainer, pl_module),
            "engine_steps": getattr(trainer.strategy.model, "global_steps", trainer.global_step),
        }


def phase_resume(d: str, world: int) -> None:
    counts = spy()
    for name in STRATEGIES:
        out = f"{d}/{name}"
        with open(f"{out}/ref.json") as f:
            ref = json.load(f)
        final = load_file(f"{out}/ref-final-r{rank()}.safetensors")
        files = sorted(os.listdir(f"{out}/ck"))
        mc_file = next(f for f in files if f.startswith("epoch=1-"))
        for label, ckpt, epoch_ref in (("from ModelCheckpoint", mc_file, 1), ("from save_checkpoint", "manual-epoch0.ckpt", 0)):
            L.seed_everything(0)
            net = Net(mode=MODE.get(name, name))
            at = AtStart()
            plugin = ShardkeeperCheckpointIO(f"{out}/root-{epoch_ref}", writer=WRITER)
            t = trainer(make_strategy(name, world), plugin, f"{out}/ck-{epoch_ref}", world, [at])
            t.fit(net, loader(), ckpt_path=f"{out}/ck/{ckpt}")
            if WRITER == "process":
                note_persist_processes(checks, f"{name} {label}", plugin.manager().options, f"{d}/persist-pids-r{rank()}")
            step0 = at.seen["global_step"]
            check(f"{name} {label}: resumed at global_step {step0}, epoch {at.seen['epoch']}", step0 == (epoch_ref + 1) * ref["global_step"] // EPOCHS == at.seen["engine_steps"] and at.seen["epoch"] == epoch_ref + 1, (at.seen["epoch"], at.seen["engine_steps"]))
            compare(name, f"{label} (at resume)", load_file(f"{out}/ref-epoch{epoch_ref}-r{rank()}.safetensors"), at.seen["state"])
            saved = ref["saves"][str(step0)][0 if epoch_ref == 0 else -1]  # manual first, ModelCheckpoint last
            check(f"{name} {label}: callback states (EarlyStopping, a stateful callback) restored",
                  at.seen["es"] == saved["es"] and at.seen["epochs"] == saved["epochs"] == epoch_ref + 1, (at.seen["es"], at.seen["epochs"], saved))
            later = {int(k): v for k, v in ref["losses"].items() if int(k) >= step0}
            got = {k: v for k, v in net.losses.items() if k >= step0}
            check(f"{name} {label}: {len(later)} later losses bit for bit", got == later and len(later) > 0, {k: (later.get(k), got.get(k)) for k in list(later)[:3]})
            compare(name, f"{label} (final)", final, state_of(t, net))
            check(f"{name} {label}: global_step and scheduler", t.global_step == ref["global_step"] and t.lr_scheduler_configs[0].scheduler.state_dict() == ref["sched"], t.lr_scheduler_configs[0].scheduler.state_dict())
    check("no torch.save and no DCP save by any strategy", counts == {"torch.save": 0, "dcp.save": 0}, counts)


def phase_cross(d: str) -> None:
    from shardkeeper.core import CheckpointManager

    # (a) FSDP2 at dp=2 -> ddp in one process: parameters and AdamW moments come back.
    out = f"{d}/fsdp2"
    mc_file = next(f for f in sorted(os.listdir(f"{out}/ck")) if f.startswith("epoch=1-"))
    L.seed_everything(0)
    net = Net()
    at = AtStart()
    plugin = ShardkeeperCheckpointIO(f"{d}/cross-root", per_rank="modulo")
    t = trainer("ddp", plugin, f"{d}/cross-ck", 1, [at], epochs=3)
    t.fit(net, loader(), ckpt_path=f"{out}/ck/{mc_file}")
    ref1 = load_file(f"{out}/ref-epoch1-r0.safetensors")
    compare("fsdp2 dp=2 -> ddp 1 process", "at resume", ref1, at.seen["state"])
    check("fsdp2 -> ddp: global_step", at.seen["global_step"] > 0, at.seen["global_step"])

    # (b) written by the core directly, restored in a Trainer.
    L.seed_everything(1)
    src = Net()
    opt = torch.optim.AdamW(src.parameters(), lr=0.05)
    x, y = next(iter(loader()))
    torch.nn.functional.mse_loss(src.model(x), y).backward()
    opt.step()
    with CheckpointManager(f"{d}/core-root") as mgr:
        mgr.save(7, {"model": src, "optim": opt}, async_save=False)
    ref = full_state(src, opt)
    L.seed_everything(0)
    net = Net()
    at = AtStart()
    plugin = ShardkeeperCheckpointIO(f"{d}/core-root")
    t = trainer("ddp", plugin, f"{d}/core-ck", 1, [at], epochs=1)
    t.fit(net, loader(), ckpt_path=plugin.step_path(7))
    compare("core-written checkpoint", "in a Trainer", ref, at.seen["state"])

    cross_import(d)
    cross_import_sharded(d)
    cross_out_of_lightning(d, ref1)


def stock_trainer(d: str, epochs: int, cbs: list[Any], **kw: Any) -> L.Trainer:
    """One process, Lightning's own checkpointing unless a plugin is given; files under d."""
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=cbs, deterministic=True, default_root_dir=d, **kw)


def cross_import(d: str) -> None:
    """A Lightning .ckpt (written by Lightning itself) imported, then resumed with the plugin:
    the same state and later losses as Lightning's own resume from the .ckpt."""
    import warnings

    from shardkeeper.lightning import import_lightning_checkpoint

    L.seed_everything(0)
    stock_trainer(d, 2, [EarlyStopping("train_loss", patience=100), ModelCheckpoint(dirpath=f"{d}/native", save_top_k=-1)]).fit(Net(), loader())
    ckpt = f"{d}/native/" + next(f for f in sorted(os.listdir(f"{d}/native")) if f.startswith("epoch=0-"))
    try:
        import_lightning_checkpoint(ckpt, f"{d}/imported", module=Net())
        check("import refuses without trust_pickle", False, "no error")
    except PermissionError as e:
        check("import refuses without trust_pickle", "trust_pickle=True" in str(e) and ckpt in str(e), e)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step = import_lightning_checkpoint(ckpt, f"{d}/imported", module=Net(), trust_pickle=True)
    check("import warns with trust_pickle=True", any("unpickling" in str(x.message) for x in w), [str(x.message) for x in w])
    results = {}
    for label in ("lightning", "imported"):
        L.seed_everything(0)
        net = Net()
        at = AtStart()
        cbs: list[Any] = [at, EarlyStopping("train_loss", patience=100)]
        if label == "imported":
            plugin = ShardkeeperCheckpointIO(f"{d}/imported")
            t = stock_trainer(d, 3, cbs, plugins=[plugin], enable_checkpointing=False)
            t.fit(net, loader(), ckpt_path=plugin.step_path(step))
        else:
            t = stock_trainer(d, 3, cbs, enable_checkpointing=False)
            t.fit(net, loader(), ckpt_path=ckpt)
        results[label] = (at.seen, net.losses, full_state(net, t.optimizers[0]), t.lr_scheduler_configs[0].scheduler.state_dict(), t.global_step)
    a, b = results["lightning"], results["imported"]
    check(f"imported .ckpt: resumed at global_step {b[0]['global_step']} as Lightning's resume", a[0]["global_step"] == b[0]["global_step"] == step > 0 and a[0]["epoch"] == b[0]["epoch"], (a[0]["global_step"], b[0]["global_step"], step))
    compare("imported .ckpt", "at resume vs the .ckpt resume", a[0]["state"], b[0]["state"])
    compare("imported .ckpt", "final vs the .ckpt resume", a[2], b[2])
    check("imported .ckpt: later losses bit for bit", a[1] == b[1] and len(a[1]) > 0, (list(a[1].items())[:2], list(b[1].items())[:2]))
    check("imported .ckpt: scheduler and global_step", a[3] == b[3] and a[4] == b[4], (a[3], b[3]))


def cross_import_sharded(d: str) -> None:
    """Lightning's sharded directory (ModelParallel dp=2) imported in this one process: the
    parameters and AdamW moments bit for bit, and a Trainer resumes from the imported step."""
    import warnings

    from shardkeeper.core import CheckpointManager
    from shardkeeper.lightning import import_lightning_checkpoint

    src, root = f"{d}/stock-sharded/sharded.ckpt", f"{d}/imported-sharded"
    try:
        import_lightning_checkpoint(src, root)
        check("sharded import refuses without trust_pickle", False, "no error")
    except PermissionError as e:
        check("sharded import refuses without trust_pickle", "trust_pickle=True" in str(e) and src in str(e) and not os.path.exists(root), e)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step = import_lightning_checkpoint(src, root, trust_pickle=True)
    check("sharded import warns with trust_pickle=True", any("unpickling" in str(x.message) for x in w), [str(x.message) for x in w])
    ref = load_file(f"{d}/stock-sharded/ref.safetensors")
    torch.manual_seed(5)
    plain = Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    with CheckpointManager(root) as mgr:
        keys = set(mgr.manifest(step).leaves)
        mgr.restore({"model": plain, "optim": opt}, step=step, only=["model/*", "optim/*"])
    compare("sharded import", "parameters and AdamW moments (via the core)", ref, full_state(plain, opt))
    want = ("progress/schema", "progress/step", "progress/lightning/loops/fit_loop/", "sched/last_epoch", "extra/callbacks/EarlyStopping", "optim/param_groups")
    check("sharded import: canonical keys (progress, loops, sched, callbacks)", all(any(k.startswith(w) for k in keys) for w in want), sorted(keys)[:40])
    L.seed_everything(0)
    net = Net()
    at = AtStart()
    plugin = ShardkeeperCheckpointIO(root)
    t = stock_trainer(d, 2, [at, EarlyStopping("train_loss", patience=100)], plugins=[plugin], enable_checkpointing=False)
    t.fit(net, loader(), ckpt_path=plugin.step_path(step))
    check(f"sharded import: a Trainer resumed at global_step {at.seen['global_step']}, epoch {at.seen['epoch']}",
          at.seen["global_step"] == step > 0 and at.seen["epoch"] == 1 and t.global_step > step, (step, t.global_step))
    compare("sharded import", "in a Trainer at resume", ref, at.seen["state"])


def cross_out_of_lightning(d: str, ref1: dict[str, torch.Tensor]) -> None:
    """The plugin's ModelParallel FSDP2 checkpoint (dp=2, step 8) restored outside Lightning:
    into plain torch through the core, and into a DeepSpeed ZeRO-2 engine through the adapter."""
    from shardkeeper.core import CheckpointManager
    from shardkeeper.core.adapter.registry import load_adapter

    root = f"{d}/fsdp2/root"
    torch.manual_seed(5)
    plain = Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": plain, "optim": opt}, step=8, only=["model/*", "optim/*"])
    compare("fsdp2 (Lightning plugin) -> plain torch", "via the core", ref1, full_state(plain, opt))

    torch.manual_seed(5)
    m = Net()
    engine, *_ = deepspeed.initialize(
        model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9},
    )
    with CheckpointManager(root) as mgr:
        mgr.restore(load_adapter("deepspeed").engine_state(engine), step=8, only=["model/*", "optim/*"])
    moments = {k: v for k, v in ref1.items() if not k.endswith("/step")}
    compare("fsdp2 (Lightning plugin) -> DeepSpeed ZeRO-2 engine", "via the adapter", moments, deepspeed_full_state(engine))


def main() -> None:
    phase, d = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    phases = {"train": lambda: phase_train(d, world), "resume": lambda: phase_resume(d, world)}
    run = phases.get(phase, lambda: phase_cross(d))
    if not checks.guard(f"{phase} raised", run):
        print(checks.items[-1]["detail"], file=sys.stderr)
    if rank() == 0:
        checks.write(f"{d}/{phase}.json")


if __name__ == "__main__":
    main()
