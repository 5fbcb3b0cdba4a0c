"""The methods ``enable`` (``plugin.py``) puts on a Trainer instance, in place of the Trainer's
own (``_internals.METHODS``): ``train`` and the start-up steps it runs, which resume from a
shardkeeper step, ``_save_checkpoint`` (the plugin's ``save_checkpoint``) and the loaders. Where
the resume is not shardkeeper's (a folder the Trainer wrote, or no resume), each calls the
Trainer class's own method."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from shardkeeper.core import CheckpointManager
from shardkeeper.transformers import _internals as tfi
from shardkeeper.transformers.position import KEY, Position
from shardkeeper.transformers.resume import Resume
from shardkeeper.transformers.state import PER_PROCESS, TrainerProgress, deepspeed_engine_state, is_deepspeed, raw_model

log = logging.getLogger(__name__)

#: Keys the resume restores at each point of the Trainer's start-up.
_MODEL_ONLY = ("model/*",)
_MODEL = (*_MODEL_ONLY, "progress/*")
_OPTIM = ("optim/*", "sched/*")


class Plugin(Protocol):
    """What the methods use of the Trainer's ``plugin.TrainerPlugin``."""

    resume: Resume | None
    progress: TrainerProgress
    data: Position

    def manager(self, root: str | None = None) -> CheckpointManager: ...
    def resolve(self, target: Any) -> Resume | str | None: ...
    def check_start(self, target: Resume | str | None) -> None: ...
    def restore(self, patterns: Sequence[str], *, model_only: bool = False) -> None: ...
    def restore_position(self) -> None: ...
    def save_checkpoint(self, model: Any, trial: Any) -> None: ...
    def sync_folders(self) -> None: ...
    def wait(self) -> None: ...
    def settle(self, when: str) -> None: ...


def replacements(tr: Any, p: Plugin, own: tfi.Originals) -> dict[str, Any]:
    """The methods ``enable`` puts on the Trainer ``tr`` (``own``: the class's, called where
    the resume is not shardkeeper's), by ``_internals.replace_methods``' names."""
    return {
        "train": _train(tr, p, own),
        **_start_up(tr, p, own),
        "save_checkpoint": p.save_checkpoint,
        **_loaders(tr, p, own),
        **_data(tr, p, own),
    }


def _train(tr: Any, p: Plugin, own: tfi.Originals) -> Any:
    """``train``: resolves the resume target, hands the Trainer only a folder of its own, and
    leaves no save of this call in flight when it returns or raises."""

    def train(
        resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: Any = None, **kw: Any
    ) -> Any:
        p.settle("before this train() call")  # a save a failed call left in flight counts
        try:
            target = p.resolve(resume_from_checkpoint)
            p.check_start(target)
        finally:
            p.sync_folders()  # a folder whose step went goes, a missing one comes
        if isinstance(target, Resume):
            log.info("shardkeeper: resuming from step %d of %s", target.step, target.manager.storage.url)
        p.resume = target if isinstance(target, Resume) else None
        p.progress.loaded = None
        p.data.begin(_keeps_own_sampler(target))
        done = False
        try:  # a folder of the Trainer's own goes to the Trainer as it is; a step is resumed here
            own_folder = target if isinstance(target, str) else None
            out = own.train(
                tr, resume_from_checkpoint=own_folder, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kw
            )
            p.wait()  # the last save committed (or its failure raised) before train() returns
            p.sync_folders()  # those the Trainer's end of training removed come back
            done = True
            return out
        finally:
            p.resume = None
            if not done:
                p.settle("after train() failed")  # its saves end before the error reaches the caller

    return train


def _start_up(tr: Any, p: Plugin, own: tfi.Originals) -> dict[str, Any]:
    """``inner_training_loop``, ``init_training_state`` and ``prepare_for_training``: the
    model, the ``TrainerState`` and (under DeepSpeed) the engine's state restored where the
    Trainer's start-up would read its own folder."""

    def inner_training_loop(
        batch_size: Any = None,
        args: Any = None,
        resume_from_checkpoint: Any = None,
        trial: Any = None,
        ignore_keys_for_eval: Any = None,
    ) -> Any:
        if p.resume is not None:
            resume_from_checkpoint = p.resume.url  # the Trainer's resume branches run; our loaders read
            # the model before it is wrapped (DDP) and prepared; under DeepSpeed, with the engine
            p.restore(("progress/*",) if is_deepspeed(tr) else _MODEL, model_only=True)
        return own.inner_training_loop(tr, batch_size, args, resume_from_checkpoint, trial, ignore_keys_for_eval)

    def prepare_for_training(max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if p.resume is None or not is_deepspeed(tr):
            return own.prepare_for_training(tr, max_steps, train_dataloader, resume_from_checkpoint)
        # no checkpoint: it would call deepspeed_load_checkpoint, which reads DeepSpeed's folders
        out = own.prepare_for_training(tr, max_steps, train_dataloader, None)
        p.restore(("progress/*", *_MODEL_ONLY, *_OPTIM, "extra/grad_scaler/*"))  # into the engine it made
        return out

    def init_training_state(
        max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: Any, resume_from_checkpoint: Any, trial: Any
    ) -> Any:
        done, skip = own.init_training_state(
            tr, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if p.resume is None:
            return done, skip
        from transformers import TrainerState

        fields = {f.name for f in dataclasses.fields(TrainerState)}
        saved = {k: v for k, v in p.progress.trainer_state().items() if k in fields and k not in PER_PROCESS}
        if set(saved) <= {"global_step", "epoch"}:  # another framework's checkpoint: its step count
            for k, v in saved.items():
                setattr(tr.state, k, v)
        else:
            tr.state = TrainerState(**saved)
            if tr.state.train_batch_size is not None:  # the Trainer's warning on changed arguments
                from transformers.trainer_utils import compare_trainer_and_checkpoint_args

                compare_trainer_and_checkpoint_args(tr.args, tr.state)
            tfi.load_callback_state(tr)
        gs = int(tr.state.global_step)
        per_epoch = num_update_steps_per_epoch
        done = gs // per_epoch
        skip = 0 if tr.args.ignore_data_skip else (gs % per_epoch) * tr.args.gradient_accumulation_steps
        tr.state.init_training_references(tr, max_steps, num_train_epochs, trial)
        if p.data.sampler is not None and any(k.startswith(KEY + "/") for k in p.resume.keys):
            p.restore_position()  # the loop starts at the position's epoch, the sampler where it stood
            done, skip = p.data.resumed()
            p.data.warn_if_cut(tr, max_steps, num_update_steps_per_epoch, num_train_epochs, done, skip)
        return done, skip

    return {
        "inner_training_loop": inner_training_loop,
        "init_training_state": init_training_state,
        "prepare_for_training": prepare_for_training,
    }


def _loaders(tr: Any, p: Plugin, own: tfi.Originals) -> dict[str, Any]:
    """The Trainer's loaders: each restores its keys of the resumed step (the model's was
    restored before it was wrapped), or is the Trainer's own when the resume is not ours;
    ``load_best_model`` restores the best step when it is committed."""

    def load_optimizer_and_scheduler(checkpoint: Any) -> None:
        if p.resume is None:
            own.load_optimizer_and_scheduler(tr, checkpoint)
            return None
        p.restore(_OPTIM)
        return None

    def load_scaler(checkpoint: Any) -> None:
        if p.resume is None:
            own.load_scaler(tr, checkpoint)
            return None
        p.restore(("extra/grad_scaler/*",))
        return None

    def load_rng_state(checkpoint: Any) -> None:
        if p.resume is None:
            own.load_rng_state(tr, checkpoint)
            return None
        if p.data.rng_at_first_step:  # a mid-epoch position: at the first batch, as after a skip
            return None
        p.restore(("rng/*",))
        return None

    def load_from_checkpoint(resume_from_checkpoint: Any, model: Any = None) -> None:
        if p.resume is None:
            own.load_from_checkpoint(tr, resume_from_checkpoint, model)
            return None
        return None  # the model was restored before it was wrapped

    def load_best_model() -> None:
        best = tr.state.best_global_step
        mgr = p.manager()
        if not best or not mgr.is_committed(int(best)):
            own.load_best_model(tr)
            return None
        log.info(
            "shardkeeper: the best model is step %d (%s %s)", best, tr.args.metric_for_best_model, tr.state.best_metric
        )
        model = deepspeed_engine_state(tr)["model"] if is_deepspeed(tr) else raw_model(tr)
        mgr.restore({"model": model}, step=int(best), only="model/*")
        return None

    return {
        "load_optimizer_and_scheduler": load_optimizer_and_scheduler,
        "load_scaler": load_scaler,
        "load_rng_state": load_rng_state,
        "load_from_checkpoint": load_from_checkpoint,
        "load_best_model": load_best_model,
    }


def _data(tr: Any, p: Plugin, own: tfi.Originals) -> dict[str, Any]:
    """``_get_train_sampler`` and ``get_train_dataloader``: the class's own (a subclass's
    override still runs), the Trainer's own sampler given the world-size independent one."""

    def get_train_sampler(train_dataset: Any = None) -> Any:
        return p.data.train_sampler(tr, own.get_train_sampler, train_dataset)

    def get_train_dataloader() -> Any:
        return p.data.attach(tr, own.get_train_dataloader(tr))

    return {"get_train_sampler": get_train_sampler, "get_train_dataloader": get_train_dataloader}


def _keeps_own_sampler(target: Resume | str | None) -> str:
    """Why a ``train()`` resuming ``target`` keeps the Trainer's own sampler: a step without a
    position was saved with it, and its batch skip resumes that order ("": none)."""
    if isinstance(target, str):
        return "a resume from a folder the Trainer wrote"
    if isinstance(target, Resume) and not any(k.startswith(KEY + "/") for k in target.keys):
        return f"a resume from step {target.step}, saved without a data position"
    return ""


__all__ = ["Plugin", "replacements"]
