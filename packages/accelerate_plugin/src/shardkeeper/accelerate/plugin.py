"""``enable(accelerator)``: ``save_state`` / ``load_state`` go entirely through shardkeeper.

The first ``accelerator.backward()`` (before the first training step, after any
``load_state()``) checks the root: a fresh run on a root holding later steps could save none
of its checkpoints there, and is refused with the remedies instead of at its first save."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, cast

from shardkeeper.accelerate import _internals as acci
from shardkeeper.accelerate.config import resolve_settings, split_settings
from shardkeeper.accelerate.dataloaders import track, untrack
from shardkeeper.accelerate.state import FRAMEWORK, build_state, global_rank
from shardkeeper.core import CheckpointManager, SaveHandle, parse_step_dir
from shardkeeper.core.adapter import Patches, RootManagers, check_save_step, check_start

log = logging.getLogger(__name__)

_ATTR = "_shardkeeper"
#: Where an Accelerate user sets ``per_rank`` (named by the core's messages about it).
PER_RANK_CALL = "enable(accelerator, per_rank=...)"
#: Distributed types whose state the generic path (torch's state-dict API) handles; DEEPSPEED
#: delegates the engine to the DeepSpeed adapter (state.deepspeed_engine_state).
GENERIC_TYPES = {
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_XPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_NPU",
    "MULTI_HPU",
    "MULTI_NEURON",
    "FSDP",
}


def _dtype_name(accelerator: Any) -> str:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))


class AcceleratePlugin:
    """Owns the checkpoint managers of one Accelerator and its save/load."""

    def __init__(self, accelerator: Any, settings: dict[str, Any]) -> None:
        self._acc = weakref.ref(accelerator)
        self.settings, self.options = split_settings(settings)
        import accelerate

        self._managers = RootManagers(
            FRAMEWORK,
            accelerate.__version__,
            {**self.options, "metadata": self.settings.get("metadata")},
            per_rank_call=PER_RANK_CALL,
        )
        self.last_handle: SaveHandle | None = None
        self.patches = Patches()  # what enable() replaced on the Accelerator (disable() undoes it)
        self.started = False  # the root was checked before the first training step
        self.loaded = False  # load_state() restored a step

    @property
    def accelerator(self) -> Any:
        acc = self._acc()
        if acc is None:
            raise RuntimeError("the Accelerator of this shardkeeper plugin was garbage-collected")
        return acc

    # -- where -------------------------------------------------------------------------------
    def default_root(self) -> str:
        if self.settings.get("root"):
            return str(self.settings["root"])
        project_dir = self.accelerator.project_dir
        if project_dir:
            return os.path.join(project_dir, "checkpoints")
        raise ValueError(
            "shardkeeper.accelerate: no checkpoint root: pass save_state(output_dir) / "
            "load_state(input_dir), enable(accelerator, root=...), set $SHARDKEEPER_ROOT, or give "
            "the Accelerator a project_dir (ProjectConfiguration(project_dir=...))"
        )

    def keep_last(self) -> int | None:
        if self.settings.get("keep_last") is not None:
            return int(self.settings["keep_last"])
        return cast("int | None", self.accelerator.project_configuration.total_limit)

    def manager(self, root: str) -> CheckpointManager:
        return self._managers.get(
            root,
            keep_last=self.keep_last(),
            keep_every=self.settings.get("keep_every"),
            storage_options=self.settings.get("storage_options"),
        )

    def _check_supported(self, what: str) -> None:
        kind = _dtype_name(self.accelerator)
        if kind in GENERIC_TYPES:
            return
        if kind == "DEEPSPEED":
            from shardkeeper.core.adapter import load_adapter

            try:
                load_adapter("deepspeed")
            except ImportError as e:
                raise ImportError(
                    f"shardkeeper.accelerate: {what} under DistributedType.DEEPSPEED delegates the "
                    f"engine's state to the DeepSpeed adapter, which is missing: {e}"
                ) from e
            return
        raise NotImplementedError(
            f"shardkeeper.accelerate: {what} under DistributedType.{kind} is not supported (supported: "
            f"{', '.join(sorted(GENERIC_TYPES))}); do not enable shardkeeper for this run"
        )

    def check_start(self) -> None:
        """Before the first training step (the first ``backward``, on every rank): refuse a run
        whose next save (the iteration counter) could not commit under the default root (the
        core's ``check_start``). Without a default root, each ``save_state(output_dir)`` checks."""
        if self.started:
            return
        try:
            root = self.default_root()
        except ValueError:
            root = None
        if root is not None:
            n = int(self.accelerator.project_configuration.iteration)
            check_start(
                self.manager(root),
                n,
                "shardkeeper.accelerate",
                resume="accelerator.load_state() before training",
                elsewhere="enable(accelerator, root=...), or another project_dir",
                resumed=self.loaded,
                first_save=n,
            )
        self.started = True

    # -- save --------------------------------------------------------------------------------
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, *, step: int | None = None, **kwargs: Any
    ) -> str:
        """Save everything Accelerate would save, as one shardkeeper checkpoint; return its path.

        The step is ``step`` if given, else ``project_configuration.iteration`` (the counter
        behind ``checkpoint_<n>``); the counter advances by one either way. Retention
        (``total_limit`` / ``keep_last``) runs after the commit.
        """
        del safe_serialization  # nothing is pickled here anyway
        if kwargs:
            raise TypeError(f"shardkeeper save_state: unsupported argument(s) {', '.join(sorted(kwargs))}")
        acc = self.accelerator
        self._check_supported("save_state")
        pc = acc.project_configuration
        root = self.default_root() if (pc.automatic_checkpoint_naming or output_dir is None) else str(output_dir)
        mgr = self.manager(root)
        n = int(pc.iteration) if step is None else int(step)
        # a previous save's failure surfaces here; every rank gets rank 0's answer
        check_save_step(mgr, n).raise_if_refused(
            "shardkeeper.accelerate save_state",
            "Call accelerator.load_state() first to continue the iteration counter, set "
            "accelerator.project_configuration.iteration, or pass save_state(step=...).",
        )
        self.started = True  # this run's saves check their own steps from now on
        for dl in acci.prepared_dataloaders(acc):
            track(dl)
        state = build_state(acc, step=n, next_iteration=max(int(pc.iteration), n) + 1)
        self.last_handle = mgr.save(n, state, metadata={"accelerate_distributed_type": _dtype_name(acc)})
        pc.iteration = max(int(pc.iteration), n) + 1
        return mgr.step_url(n)

    # -- load --------------------------------------------------------------------------------
    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        step: int | None = None,
        strict: bool = True,
        **kwargs: Any,
    ) -> int:
        """Restore everything ``save_state`` saved, in place; return the step restored.

        ``input_dir``: a root (newest committed step, or ``step``) or one step's folder.
        """
        del load_kwargs
        kwargs.pop("map_location", None)  # tensors land in the targets' own memory
        if kwargs:
            raise TypeError(f"shardkeeper load_state: unsupported argument(s) {', '.join(sorted(kwargs))}")
        acc = self.accelerator
        self._check_supported("load_state")
        root = self.default_root() if input_dir is None else str(input_dir).rstrip("/")
        if input_dir is not None and step is None:
            # A step's folder (``step-000000000042``, the core's name), confirmed with ``mgr.step_url``.
            parent, _, last = root.rpartition("/")
            named = parse_step_dir(last)
            if named is not None and parent:
                candidate = self.manager(parent)
                if candidate.step_url(named).rstrip("/").endswith("/" + last):
                    root, step = parent, named
        mgr = self.manager(root)
        mgr.wait()
        for dl in acci.prepared_dataloaders(acc):
            track(dl)
        target = step if step is not None else _newest(mgr, root, global_rank())
        present = list(mgr.manifest(target).leaves)
        state = build_state(acc, present=present, resume_dataloaders=bool(self.settings.get("resume_dataloaders")))
        restored = mgr.restore(state, step=target, strict=strict)
        self.loaded = True
        log.info("shardkeeper: restored step %d from %s", restored, root)
        return restored

    # -- lifecycle ---------------------------------------------------------------------------
    def wait(self) -> None:
        self._managers.wait()

    def close(self) -> None:
        self._managers.close()


def _newest(mgr: CheckpointManager, root: str, rank: int) -> int:
    step = mgr.latest_step()
    if step is None:
        from shardkeeper.core import CheckpointNotFoundError

        raise CheckpointNotFoundError(
            f"shardkeeper: no committed checkpoint under {root} (rank {rank}); check the root, or "
            f"start from scratch without load_state()"
        )
    return step


def enable(accelerator: Any, root: str | None = None, **options: Any) -> AcceleratePlugin:
    """Route ``accelerator.save_state()`` / ``load_state()`` through shardkeeper.

    Settings, highest first: these arguments > ``SHARDKEEPER_*`` variables > the config file
    (``shardkeeper.config.config_file_path()``) > defaults. Returns the plugin (also at
    ``accelerator._shardkeeper``). Enabling again replaces the plugin (its pending saves are
    committed first); :func:`disable` gives the Accelerator its own methods back.
    """
    acci.require_accelerator(accelerator)
    acci.warn_if_untested()
    settings = resolve_settings({"root": root, **options})
    existing: AcceleratePlugin | None = getattr(accelerator, _ATTR, None)
    if existing is not None:  # enabled again: the new settings replace the old plugin
        disable(accelerator)
    plugin = AcceleratePlugin(accelerator, settings)
    plugin._check_supported("enable()")  # fail at start-up, not at the first save
    patches = plugin.patches
    patches.set(accelerator, _ATTR, plugin)
    patches.set(accelerator, "save_state", plugin.save_state)
    patches.set(accelerator, "load_state", plugin.load_state)
    for dl in acci.prepared_dataloaders(accelerator):
        track(dl)
    cls = type(accelerator)

    def prepare_data_loader(data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        dl = cls.prepare_data_loader(accelerator, data_loader, *args, **kwargs)
        track(dl)
        return dl

    def end_training() -> None:
        plugin.close()
        cls.end_training(accelerator)

    def backward(loss: Any, **kwargs: Any) -> Any:
        plugin.check_start()
        return cls.backward(accelerator, loss, **kwargs)

    patches.set(accelerator, "prepare_data_loader", prepare_data_loader)
    patches.set(accelerator, "backward", backward)
    patches.set(accelerator, "end_training", end_training)
    return plugin


def disable(accelerator: Any) -> None:
    """Wait for the pending saves, close the managers, and give the Accelerator its own
    ``save_state`` / ``load_state`` / ``prepare_data_loader`` / ``end_training`` /
    ``backward`` back."""
    plugin: AcceleratePlugin | None = getattr(accelerator, _ATTR, None)
    if plugin is None:
        return
    try:
        plugin.close()
    finally:
        plugin.patches.restore()
        for dl in acci.prepared_dataloaders(accelerator):
            untrack(dl)


def plugin_of(accelerator: Any) -> AcceleratePlugin:
    p = getattr(accelerator, _ATTR, None)
    if p is None:
        raise RuntimeError(
            "shardkeeper is not enabled on this Accelerator: call shardkeeper.accelerate.enable(accelerator)"
        )
    return cast("AcceleratePlugin", p)


def wait(accelerator: Any) -> None:
    """Block until the accelerator's pending checkpoint saves are committed (re-raise failures)."""
    plugin_of(accelerator).wait()


__all__ = ["AcceleratePlugin", "GENERIC_TYPES", "disable", "enable", "log", "plugin_of", "wait"]
