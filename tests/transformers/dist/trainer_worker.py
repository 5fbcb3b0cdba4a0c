"""The real Trainer (a tiny GPT-2 from a config, CPU) saving through shardkeeper: one process,
DDP, DeepSpeed ZeRO or FSDP2 under torchrun (gloo).

    trainer_worker.py MODE OUT [LAYOUT]

``reference``: 12 steps uninterrupted (saves at 4, 8, 12 into ``OUT/ref``); records every
micro-step's loss and the final parameters and AdamW state. ``crash``: the same run into
``OUT/run`` with async saves; the manifest of step 8 is held back and every rank kills itself
(SIGKILL) with that save in flight. ``resume``: in a new process, ``get_last_checkpoint(OUT/run)``
must name ``checkpoint-4`` (the folder of the newest committed step, none for the torn one),
and ``train(resume_from_checkpoint=<that folder>)`` must resume at step 4 (mid-epoch: 6 steps
an epoch); every later loss and the final state must equal the reference's bit for bit, and
the folders must then be those of the committed steps. Each rank writes its checks to
``OUT/<mode>-rank<r>.json`` and its losses and state to ``OUT/<mode>-rank<r>.pt``.
``reference+crash``: both, one after the other in one launch.

``SK_WRITER=process``: the Trainers write with ``writer="process"``. Then ``crash`` holds no
manifest: each rank waits for step 4's commit (its persist processes have met then), stops
(SIGSTOP) its persist processes before the save of step 8, notes their pids in
``OUT/persist-pids-r<rank>`` once ``save()`` returned on every rank, and kills itself; a
detached process continues them (SIGCONT) once that trainer is gone, so that step 8 is written
and committed after every trainer died. ``resume`` must find step 8 committed
(``latest_step()`` waits for commits in flight on the node) and resume from it with
``resume_from_checkpoint=True`` (that ``train()`` writes its ``checkpoint-8`` folder: its
trainer was gone at the commit).

``LAYOUT``: ``zero1``, ``zero2`` or ``zero3``: the Trainer runs under DeepSpeed ZeRO with the
Trainer's own AdamW, and the state compared is the engine's full fp32 parameters and Adam
moments; ``fsdp2``: the model is sharded at load time by transformers itself
(``from_pretrained(distributed_config=DistributedConfig(fsdp_size=world))``, DTensor
parameters), which the Trainer alone refuses to checkpoint; ``plugin-fsdp2`` and
``plugin-fsdp1``: Accelerate's FSDP plugin (``args.fsdp``) shards the model as it prepares it
(on CPU through ``tests/transformers/cpu_fsdp.py``). ``cross LAYOUT`` (none: one
process): a Trainer of that layout resumes a copy of the reference's step 12 (another layout's
and world size's): at the start of its training it must hold that state, bit for bit, and it
trains 2 more steps (RNG restore included).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests.checks import Checks, deepspeed_full_state, state_of
from tests.persist_probe import note_persist_processes, persist_children

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402
from shardkeeper.core.commit.committed import manifest_path  # noqa: E402
from shardkeeper.transformers import plugin_of, wait  # noqa: E402
from tests.transformers import cpu_fsdp  # noqa: E402
from tests.transformers.common import SAVE_EVERY, STEPS, Recording, make_trainer, tiny_model  # noqa: E402

CRASH_AT = 8
WRITER = os.environ.get("SK_WRITER", "thread")  # the Trainer's writer option: "thread" or "process"
#: Marks a run whose model is untied (``plugin_model``), set in ``main``.
UNTIED = Path("untied")


class KillDuringSave(TrainerCallback):
    """After the save of ``CRASH_AT`` was handed to the background (its manifest held back),
    every rank kills itself: that step is in flight and must never be resumed from. With the
    process writer nothing is held: the persist processes are stopped before that save (once
    the previous one committed: they have met) and continued once their trainer is gone, so
    they commit it after every trainer died."""

    def __init__(self, trainer: Recording) -> None:
        self.trainer = trainer
        self.stopped: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == CRASH_AT and WRITER == "process":  # (its save comes next)
            wait(self.trainer)
            self.stopped = persist_children()
            for pid in self.stopped:
                os.kill(pid, signal.SIGSTOP)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == CRASH_AT and WRITER == "process":
            out = Path(args.output_dir).parent
            (out / f"persist-pids-r{args.process_index}").write_text("".join(f"{p}\n" for p in self.stopped))
            continue_when_gone(self.stopped)
            barrier()  # save() returned on every rank: each one's part of the step was handed over
        elif state.global_step == CRASH_AT:
            time.sleep(0.5)  # the data files are written; the manifest put waits below
        if state.global_step == CRASH_AT:
            Path(args.output_dir).parent.joinpath(f"killed-rank{args.process_index}").touch()
            os.kill(os.getpid(), signal.SIGKILL)


def continue_when_gone(pids: list[int]) -> None:
    """A detached process (holding none of the launch's pipes) that continues the stopped
    persist processes ``pids`` once this trainer's process is gone."""
    import subprocess

    subprocess.Popen(
        [sys.executable, "-c", CONTINUE_WHEN_GONE, str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


#: ``python -c`` this ``TRAINER PID...``: once the trainer's process is gone (or a zombie),
#: continue the stopped persist processes ``PID...``.
CONTINUE_WHEN_GONE = """
import os, signal, sys, time
trainer, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
def gone():
    try:
        return open(f"/proc/{trainer}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
deadline = time.monotonic() + 120
while not gone() and time.monotonic() < deadline:
    time.sleep(0.05)
for p in pids:
    os.kill(p, signal.SIGCONT)
"""


def hold_manifest(trainer: Recording, step: int) -> None:
    """Make the put of ``step``'s manifest wait forever (a slow store: the fault a real server
    cannot be asked for on cue)."""
    mgr = plugin_of(trainer).manager()
    storage = mgr.storage
    target = manifest_path(step)
    blocked = threading.Event()
    put = storage.put_if_absent

    def held(path: str, data: bytes) -> None:
        if path == target:
            blocked.wait()
        put(path, data)

    storage.put_if_absent = held  # type: ignore[method-assign]


def deepspeed_config(stage: int) -> dict[str, Any]:
    """ZeRO-``stage`` with the Trainer's AdamW and batch sizes (``auto``: from its arguments)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no shm comm op on this CPU build
    deepspeed.utils.logger.setLevel(logging.WARNING)
    auto = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return {
        **dict.fromkeys(auto, "auto"),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def sharded_at_load(out: Path) -> Any:
    """The tiny GPT-2, saved once by rank 0, loaded FSDP2-sharded over every rank by transformers."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    folder = out / "pretrained"
    if dist.get_rank() == 0 and not folder.exists():
        tiny_model().save_pretrained(folder)
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))


def plugin_model(version: int) -> dict[str, Any]:
    """The model for Accelerate's FSDP plugin: Accelerate before 1.15 puts GPT-2's tied
    embedding and LM head in two FSDP2 groups, which FSDP2 refuses at the first forward (no
    shardkeeper involved), so there the two are untied."""
    import accelerate
    from packaging.version import Version

    if version == 2 and Version(accelerate.__version__) < Version("1.15"):
        return {"model": untied_model()}
    return {}


def untied_model() -> Any:
    """The tiny GPT-2 without ties, recorded in ``UNTIED`` for ``cross`` to build the same."""
    UNTIED.touch()
    return tiny_model(tied=False)


def layout_arguments(layout: str, out: Path) -> dict[str, Any]:
    """``make_trainer`` arguments of ``layout`` ("" for none)."""
    if layout.startswith("zero"):
        return {"deepspeed": deepspeed_config(int(layout.removeprefix("zero")))}
    if layout == "fsdp2":
        return {"model": sharded_at_load(out)}
    if layout in ("plugin-fsdp1", "plugin-fsdp2"):
        cpu_fsdp.allow()
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # FSDP1 refuses a device_id of cpu:0 on cpu
        version = int(layout[-1])  # FSDP1's sync_module_states would put the model on a GPU
        config = {"version": version, "sync_module_states": version == 2}
        return {"fsdp": True, "fsdp_config": config, **plugin_model(version)}
    if layout:
        raise SystemExit(f"unknown layout {layout!r}: zero1, zero2, zero3, fsdp2, plugin-fsdp1 or plugin-fsdp2")
    return {}


def full_state(trainer: Recording) -> dict[str, Any]:
    """The trained state: the model and AdamW; the engine's fp32 masters and moments; or an
    FSDP1 root's full parameters and moments by FQN, as torch's state-dict API gathers them
    (the format of ``deepspeed_full_state``). A collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if trainer.is_deepspeed_enabled:
        return deepspeed_full_state(trainer.model_wrapped)
    if not isinstance(trainer.model, FullyShardedDataParallel):
        return state_of(trainer.model, trainer.optimizer.optimizer)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    params = get_model_state_dict(trainer.model, options=full)
    moments = get_optimizer_state_dict(trainer.model, trainer.optimizer.optimizer, options=full)["state"]
    got: dict[str, Any] = {}
    for n, st in moments.items():  # each trainable parameter once (the tied lm_head is wte)
        got[f"model/{n}"] = params[n].detach().clone()
        got.update({f"optim/{n}/{k}": st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")})
    return got


def restored_state(trainer: Recording, like: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's full state in the format of ``like`` (``full_state``'s): ``state_of``'s,
    or the engine's (``model/<fqn>`` and Adam moments, gathered from DTensors). A collective."""
    optim = trainer.optimizer.optimizer
    if any(k.startswith("param/") for k in like):
        return state_of(trainer.model, optim)

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    got: dict[str, Any] = {}
    for n, p in trainer.model.named_parameters():  # as deepspeed_full_state names them
        got[f"model/{n}"] = full(p.detach())
        got.update({f"optim/{n}/{k}": full(optim.state[p][k]) for k in ("exp_avg", "exp_avg_sq")})
    return got


class AtStart(TrainerCallback):
    """The state and step the Trainer starts training from (after every restore)."""

    def __init__(self, like: dict[str, Any]) -> None:
        self.like = like
        self.trainer: Recording | None = None
        self.state: dict[str, Any] = {}
        self.step = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        assert self.trainer is not None
        self.state, self.step = restored_state(self.trainer, self.like), int(state.global_step)


def cross(out: Path, checks: Checks, layout: str) -> None:
    """A Trainer of ``layout`` (none: one process) resumes a copy of the reference's step 12,
    another layout's and world size's, and trains 2 more steps (the RNG restore included)."""
    root = out / f"cross{layout}"
    import torch.distributed as dist

    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copytree(out / "ref", root)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.barrier()
    ref = torch.load(out / "reference-rank0.pt", weights_only=True)["state"]
    start = AtStart(ref)
    more = layout_arguments(layout, out)
    if UNTIED.exists() and "model" not in more:  # the reference's architecture
        more["model"] = tiny_model(tied=False)
    trainer = make_trainer(root, max_steps=STEPS + 2, callbacks=[start], **more)
    start.trainer = trainer
    trainer.train(resume_from_checkpoint=True)
    checks.check("resumed_at_the_step_and_trained_on", (start.step, trainer.state.global_step) == (STEPS, STEPS + 2),
                 f"started at {start.step}, ended at {trainer.state.global_step}")
    checks.same("sharded_checkpoint_restores_in_another_layout", start.state, ref)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    global UNTIED
    mode, out = sys.argv[1], Path(sys.argv[2])
    UNTIED = out / "untied"
    layout = sys.argv[3] if len(sys.argv) > 3 else ""
    rank = int(os.environ.get("RANK", "0"))
    if mode == "cross":
        checks = Checks(out / f"cross-rank{rank}.json", rank=rank)
        cross(out, checks, layout)
        checks.write()
        return
    for one in mode.split("+"):  # "reference+crash": two Trainers, one launch (its imports once)
        run(one, out, layout, rank)


def run(mode: str, out: Path, layout: str, rank: int) -> None:
    """One Trainer's run of ``mode`` (reference, crash or resume)."""
    checks = Checks(out / f"{mode}-rank{rank}.json", rank=rank)
    root = out / ("ref" if mode == "reference" else "run")
    more = layout_arguments(layout, out)
    trainer = make_trainer(root, options={"async_save": True, "writer": WRITER}, **more)
    if mode == "crash":
        if WRITER != "process":  # the persist processes commit it, held or not here
            hold_manifest(trainer, CRASH_AT)
        trainer.add_callback(KillDuringSave(trainer))
    start = CRASH_AT if WRITER == "process" else SAVE_EVERY  # the newest committed step after the crash
    if mode == "resume" and WRITER == "process":
        mgr = CheckpointManager(root)
        newest = mgr.latest_step()  # waits for the persist processes' commit of CRASH_AT
        checks.check("crashed_step_committed_by_persist_processes", newest == CRASH_AT and mgr.steps() == [SAVE_EVERY, CRASH_AT],
                     f"newest {newest}, committed: {mgr.steps()}")
        mgr.close()
        trainer.train(resume_from_checkpoint=True)
        note_persist_processes(checks, "resume", plugin_of(trainer).manager().options, out / f"persist-pids-r{rank}")
    elif mode == "resume":
        mgr = CheckpointManager(root)
        checks.check("crashed_step_not_committed", mgr.steps() == [SAVE_EVERY], f"committed: {mgr.steps()}")
        mgr.close()
        last = get_last_checkpoint(str(root))
        want = str(root / f"checkpoint-{SAVE_EVERY}")
        checks.check("newest_folder_is_the_newest_committed_step", last == want, f"{last} (want {want})")
        trainer.train(resume_from_checkpoint=last)
    else:
        trainer.train()
    state = full_state(trainer)
    torch.save({"losses": trainer.losses, "state": state}, out / f"{mode}-rank{rank}.pt")
    if mode == "resume":
        ref = torch.load(out / f"reference-rank{rank}.pt", weights_only=True)
        later = [x for x in ref["losses"] if x[0] >= start]
        checks.check("resumed_at_committed_step", trainer.losses[0][0] == start, str(trainer.losses[:1]))
        checks.check("next_losses_bit_exact", trainer.losses == later, f"{trainer.losses[:3]} vs {later[:3]}")
        checks.same("final_params_and_optimizer_bit_exact", state, ref["state"])
        steps = CheckpointManager(root).steps()
        checks.check("saves_after_resume_committed", steps == [SAVE_EVERY, CRASH_AT, STEPS], str(steps))
        barrier()  # rank 0 writes the folders before its train() returns
        folders = sorted((p.name for p in root.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))
        want_folders = [f"checkpoint-{s}" for s in steps]
        checks.check("folders_are_the_committed_steps", folders == want_folders, f"{folders} vs {want_folders}")
    checks.write()


if __name__ == "__main__":
    main()
