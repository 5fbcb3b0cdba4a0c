"""``enable(trainer)``: every checkpoint the Trainer saves and resumes goes through shardkeeper.

The Trainer's checkpoint methods are replaced on the instance (``_internals.METHODS``;
``disable`` gives them back). A save at ``global_step`` N commits step N under the root
(default: ``args.output_dir``), with the fenced protocol: a resume never sees a torn one, and
then appears as ``output_dir/checkpoint-N`` (``folders.py``). ``train(resume_from_checkpoint=True)``
resumes from the newest committed step; a step number, a root, a step folder or a ``checkpoint-N``
folder works too, and a folder the Trainer itself wrote resumes through the Trainer's own loaders.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any, cast

from shardkeeper.core import CheckpointManager, CorruptCheckpointError, SaveHandle
from shardkeeper.core.adapter import Patches, RootManagers, check_save_step, check_start, read_progress
from shardkeeper.transformers import _internals as tfi
from shardkeeper.transformers.folders import Folders
from shardkeeper.transformers.position import KEY, Position, callback
from shardkeeper.transformers.resume import Resume, resolve, trainer_folder_step, with_remedy
from shardkeeper.transformers.state import FRAMEWORK, TrainerProgress, build_state, is_deepspeed
from shardkeeper.transformers.trainer_methods import replacements

log = logging.getLogger(__name__)

_ATTR = "_shardkeeper"
#: Where a Trainer user sets ``per_rank`` (named by the core's messages about it).
PER_RANK_CALL = "enable(trainer, per_rank=...) or ShardkeeperTrainer(shardkeeper_options={'per_rank': ...})"


class TrainerPlugin:
    """Owns the checkpoint managers of one Trainer and its save and resume."""

    def __init__(self, trainer: Any, root: str | os.PathLike[str] | None, options: dict[str, Any]) -> None:
        import transformers

        self._trainer = weakref.ref(trainer)
        self.root = os.fspath(root) if root is not None else str(trainer.args.output_dir)
        self._managers = RootManagers(FRAMEWORK, transformers.__version__, options, per_rank_call=PER_RANK_CALL)
        self.progress = TrainerProgress(trainer)
        self.resume: Resume | None = None
        self.last_handle: SaveHandle | None = None
        self.patches = Patches()
        self.folders = Folders(str(trainer.args.output_dir), self.root, writer=bool(trainer.args.should_save))
        self.data = Position()  # the train sampler's position (position.py)
        self.data.restore_rng = lambda: self.restore(("rng/*",))
        self.data_callback = callback(self.data)

    @property
    def trainer(self) -> Any:
        tr = self._trainer()
        if tr is None:
            raise RuntimeError("the Trainer of this shardkeeper plugin was garbage-collected")
        return tr

    def rank(self) -> int:
        return int(self.trainer.args.process_index)

    def manager(self, root: str | None = None) -> CheckpointManager:
        """The manager of ``root`` (default: the plugin's); retention follows ``keep_last`` when
        given, else ``save_total_limit``."""
        own = {} if "keep_last" in self._managers.options else {"keep_last": self.trainer.args.save_total_limit}
        return self._managers.get(root or self.root, **own)

    # -- resume ------------------------------------------------------------------------------
    def resolve(self, target: Any) -> Resume | str | None:
        """What ``train(resume_from_checkpoint=target)`` resumes from (``resume.resolve``)."""
        return resolve(target, self.manager, self.root, self.rank())

    def check_start(self, target: Resume | str | None) -> None:
        """A run that starts below the newest step of its root could save none of the steps
        up to it: say so before training, not at its first save (the core's ``check_start``,
        a collective)."""
        if isinstance(target, Resume):
            start, source = target.step, ""
        elif isinstance(target, str):
            start, source = trainer_folder_step(target), target
        else:
            start, source = 0, ""
        check_start(
            self.manager(),
            start,
            "shardkeeper.transformers",
            resume="resume_from_checkpoint=True",
            elsewhere="another output_dir, or enable(trainer, root=...)",
            resumed=target is not None,
            source=source,
        )

    def restore(self, patterns: Sequence[str], *, model_only: bool = False) -> None:
        """Restore the keys matching ``patterns`` (``"<prefix>/*"``) of the resumed step; a
        prefix the checkpoint lacks (a ``save_only_model`` one has no optimizer, another
        framework's may have no scheduler) keeps its values, as the Trainer's own loaders do.
        ``progress/*`` is read from the manifest in any framework's layout (a plain save's
        step count is its step number)."""
        assert self.resume is not None
        mgr, step = self.resume.manager, self.resume.step
        if patterns == ("progress/*",):  # before the DeepSpeed engine exists: no state to build
            self.progress.load_progress(read_progress(mgr.manifest(step)))
            return
        state = build_state(self.trainer, self.progress, model_only=model_only)
        keys = self.resume.keys
        want = []
        for pattern in patterns:
            prefix = pattern.removesuffix("*")
            if pattern == "progress/*":
                self.progress.load_progress(read_progress(mgr.manifest(step)))
            elif pattern.split("/")[0] not in state:
                continue
            elif any(k.startswith(prefix) for k in keys):
                want.append(pattern)
            else:
                log.info("shardkeeper: step %d has no %s; it keeps its current values", step, prefix.rstrip("/"))
        if not want:
            return
        try:  # at another world size the manager's per_rank decides (default: as the Trainer does)
            mgr.restore(state, step=step, only=want, optional=["rng/*"])
        except CorruptCheckpointError as e:
            raise with_remedy(e, self.root, mgr.step_url(step), step, self.rank()) from e

    def restore_position(self) -> None:
        """The train sampler's position at the resumed step (``position.py``), alone: it is
        read before the model is prepared (under DeepSpeed, before the engine exists)."""
        assert self.resume is not None
        mgr, step = self.resume.manager, self.resume.step
        try:
            mgr.restore(self.data.state(), step=step, only=[KEY + "/*"])
        except CorruptCheckpointError as e:
            raise with_remedy(e, self.root, mgr.step_url(step), step, self.rank()) from e

    # -- save --------------------------------------------------------------------------------
    def save_checkpoint(self, model: Any, trial: Any) -> None:
        """What ``Trainer._save_checkpoint`` does, into one shardkeeper step ``global_step``."""
        del model  # the Trainer passes its wrapped model; the unwrapped one is saved
        tr = self.trainer
        if tr.hp_search_backend is None and trial is None:
            tr.store_flos()  # a collective under DDP, as in the Trainer: every rank takes it
        mgr = self.manager()
        step = int(tr.state.global_step)
        check_save_step(mgr, step).raise_if_refused(
            "shardkeeper.transformers",
            "Resume with trainer.train(resume_from_checkpoint=True), or give this run another output_dir.",
        )
        best = tr.state.best_global_step
        pinned: frozenset[int] = frozenset()
        if best and _saves_best(tr.args.save_strategy):
            if best == step or mgr.is_committed(best):
                tr.state.best_model_checkpoint = self.folders.path(int(best))
                pinned = frozenset({int(best)})  # retention keeps the best checkpoint, as the Trainer does
        mgr.retention = dataclasses.replace(mgr.retention, keep_steps=pinned)
        self.folders.before_save(mgr, step, self.last_handle)  # the folders of the steps retention drops go
        tfi.record_callback_states(tr)
        state = self.data.add_to(build_state(tr, self.progress, model_only=bool(tr.args.save_only_model)))
        self.last_handle = handle = mgr.save(
            step, state, metadata={"transformers_save_only_model": bool(tr.args.save_only_model)}
        )
        if tr.control.should_training_stop:  # the last save: the Trainer's end of training sees its folder
            handle.wait()
        self.folders.watch(mgr, handle)  # its checkpoint-N once it commits

    def sync_folders(self) -> None:
        """The folders in ``output_dir`` agree with the committed steps again (``Folders.sync``)."""
        self.folders.sync(self.manager())  # the manager on every rank: its first use is a collective

    def wait(self) -> None:
        self._managers.wait()

    def settle(self, when: str) -> None:
        """Wait for the pending saves without raising: their failure is logged (the caller
        is already handling another error, or retrying after one)."""
        try:
            self._managers.wait()
        except Exception as e:  # noqa: BLE001 - logged: the save's failure is not the caller's error
            log.warning("shardkeeper: a pending save failed (%s, rank %d): %s", when, self.rank(), e)

    def close(self) -> None:
        self._managers.close()


def _saves_best(strategy: Any) -> bool:
    """Whether the Trainer tracks a best checkpoint under ``strategy`` (as ``_save_checkpoint``)."""
    from transformers.trainer_utils import SaveStrategy

    return strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)


def _check_supported(trainer: Any) -> None:
    args = trainer.args
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        raise NotImplementedError(
            f"shardkeeper.transformers: a Trainer under FSDP on XLA (fsdp_config xla) is not supported "
            f"(rank {args.process_index}); supported: one process, DDP, DeepSpeed ZeRO-1/2/3, Accelerate's "
            f"FSDP plugin (args.fsdp, FSDP1 or FSDP2) and FSDP2 applied by transformers at load time"
        )
    if is_deepspeed(trainer):
        from shardkeeper.core.adapter import load_adapter

        try:
            load_adapter("deepspeed")
        except ImportError as e:
            raise ImportError(
                f"shardkeeper.transformers: a Trainer under DeepSpeed saves its engine's state through the "
                f"DeepSpeed adapter, which is missing (rank {args.process_index}): {e}"
            ) from e
    if args.push_to_hub:
        refuse_push_to_hub()


def refuse_push_to_hub() -> None:
    raise NotImplementedError(
        "shardkeeper.transformers: push_to_hub pushes the Trainer's own checkpoint folders, which this "
        "adapter does not write; export a step with shardkeeper.transformers.export_pretrained and push that"
    )


def enable(trainer: Any, root: str | os.PathLike[str] | None = None, **options: Any) -> TrainerPlugin:
    """Route the Trainer's checkpoints through shardkeeper; return the plugin (also at
    ``trainer._shardkeeper``).

    ``root``: where checkpoints go (default: ``args.output_dir``; ``s3://`` and ``gs://`` roots
    work). ``options`` go to the ``CheckpointManager`` (``async_save``, ``compression``,
    ``storage_options``, ``keep_last``, ...); ``keep_last`` defaults to ``save_total_limit``.
    Enabling again replaces the plugin; :func:`disable` gives the Trainer its methods back.
    """
    tfi.require_trainer(trainer)
    tfi.warn_if_untested()
    _check_supported(trainer)
    tfi.warn_if_overridden(type(trainer))
    if getattr(trainer, _ATTR, None) is not None:
        disable(trainer)
    plugin = TrainerPlugin(trainer, root, options)
    plugin.patches.set(trainer, _ATTR, plugin)
    tfi.replace_methods(plugin.patches, trainer, replacements(trainer, plugin, tfi.Originals(type(trainer))))
    trainer.add_callback(plugin.data_callback)
    return plugin


def disable(trainer: Any) -> None:
    """Wait for the pending saves, close the managers, and give the Trainer its own methods back."""
    plugin: TrainerPlugin | None = getattr(trainer, _ATTR, None)
    if plugin is None:
        return
    try:
        plugin.close()
    finally:
        plugin.patches.restore()
        plugin.trainer.remove_callback(plugin.data_callback)


def plugin_of(trainer: Any) -> TrainerPlugin:
    p = getattr(trainer, _ATTR, None)
    if p is None:
        raise RuntimeError("shardkeeper is not enabled on this Trainer: call shardkeeper.transformers.enable(trainer)")
    return cast("TrainerPlugin", p)


def wait(trainer: Any) -> None:
    """Block until the Trainer's pending checkpoint saves are committed (re-raise failures)."""
    plugin_of(trainer).wait()


__all__ = ["TrainerPlugin", "disable", "enable", "plugin_of", "refuse_push_to_hub", "wait"]
