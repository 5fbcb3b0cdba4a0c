"""How the plugin takes over a strategy's checkpointing.

Lightning hands a ``CheckpointIO`` plugin to its strategy with ``strategy.checkpoint_io =
plugin`` (``Trainer(plugins=[...])`` and ``Strategy(checkpoint_io=...)`` both end there). On
import, this module extends that property's setter: it still stores the plugin, and when the
plugin is a :class:`ShardkeeperCheckpointIO` it also *connects* it to the strategy, which
replaces, on that strategy instance only, the methods through which Lightning saves, loads and
removes checkpoints, with functions that call the plugin's public ``binding``
(:mod:`shardkeeper.lightning.binding`):

- ``save_checkpoint`` (all ranks): one shardkeeper save; the strategy writes nothing itself;
- ``load_checkpoint``: restores model (and optimizers, when they exist yet), returns the rest;
- ``load_model_state_dict`` / ``load_optimizer_state_dict``: no-ops for our checkpoints
  (the optimizers of strategies that create them after loading are restored here);
- ``lightning_module_state_dict`` / ``optimizer_state``: return ``{}`` (the plugin reads the
  live module and optimizers; Lightning's own copies would only cost time and memory);
- ``remove_checkpoint`` (all ranks): removes our pointer file (rank 0), then deletes the step
  once no path names it (``mgr.delete``, a collective);
- ``teardown``: waits for the save in flight, so ``fit()`` returns with every save committed
  and, after a normal end, on every rank once rank 0 has pointed its paths at the last step;
- ``on_train_start`` (all ranks, after any resume, before the first training step): a run
  that could save nothing in its root (a fresh ``fit()`` on a root holding later steps) is
  refused there with the remedies (the core's ``check_start``), not at its first save.
- ``on_train_batch_start``: the plugin's train samplers count the batch as taken
  (:mod:`shardkeeper.lightning.data`).

Under ``DeepSpeedStrategy`` the engine's state comes from the DeepSpeed adapter
(``load_adapter("deepspeed").engine_state(engine)``); DeepSpeed's own checkpoint methods are
never called. Other strategies and other plugins are untouched.

:func:`install` also wraps Lightning's ``.ckpt`` loader so that ``load_from_checkpoint`` and
``TorchCheckpointIO`` read the plugin's pointer files (:mod:`shardkeeper.lightning.loading`),
and the method that resolves the sampler Lightning puts in a DataLoader, so that a Trainer
with the plugin gets the plugin's resumable sampler for its train data
(:mod:`shardkeeper.lightning.data`).
Both patches are restorable (the core's ``Patches``): :func:`disconnect` gives a strategy its
own methods back, :func:`uninstall` gives ``Strategy.checkpoint_io`` its own setter and
Lightning its own loader back (strategies connected until then stay connected until
disconnected).
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.strategies import Strategy
from shardkeeper.core.adapter import check_start, load_adapter
from shardkeeper.lightning import _internals as li
from shardkeeper.lightning import strategy as st
from shardkeeper.lightning.binding import MARK
from shardkeeper.lightning.installation import INSTALLED, installed
from shardkeeper.lightning.loading import hook_loaders
from shardkeeper.lightning.plugin import ShardkeeperCheckpointIO
from shardkeeper.lightning.strategy import is_deepspeed

_UNSUPPORTED = ("XLAStrategy", "SingleDeviceXLAStrategy")


def connect(plugin: ShardkeeperCheckpointIO, strategy: Any) -> None:
    """Make ``plugin`` do ``strategy``'s checkpointing (idempotent)."""
    name = type(strategy).__name__
    if name in _UNSUPPORTED:
        raise TypeError(f"ShardkeeperCheckpointIO does not support {name}")
    li.warn_if_untested()
    if is_deepspeed(strategy):
        load_adapter("deepspeed")  # fail now, with the install hint, not at the first save
    if getattr(strategy, "_shardkeeper_plugin", None) is plugin:
        return
    if plugin.strategy is not None and plugin.strategy is not strategy:
        disconnect(plugin)
    plugin.strategy = strategy
    patches = plugin.binding.patches
    patches.set(strategy, "_shardkeeper_plugin", plugin)
    for name, fn in _methods(plugin, strategy).items():
        patches.set(strategy, name, fn)


def _methods(plugin: ShardkeeperCheckpointIO, strategy: Any) -> dict[str, Any]:
    """The methods ``connect`` puts on ``strategy``, by name: its checkpoint I/O through the
    plugin's binding, and its start and end, which check the resume and finish the saves."""
    binding = plugin.binding  # what the replacements below call
    orig_load_model = strategy.load_model_state_dict
    orig_load_optim = strategy.load_optimizer_state_dict
    orig_remove = strategy.remove_checkpoint
    orig_teardown = strategy.teardown
    orig_train_start = strategy.on_train_start
    orig_batch_start = strategy.on_train_batch_start

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        binding.save(strategy, checkpoint, filepath, storage_options)

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return binding.load(strategy, checkpoint_path)

    def load_model_state_dict(checkpoint: Any, strict: bool = True) -> None:
        if MARK not in checkpoint:
            orig_load_model(checkpoint, strict=strict)

    def load_optimizer_state_dict(checkpoint: Any) -> None:
        if MARK not in checkpoint:
            orig_load_optim(checkpoint)
            return
        binding.restore_deferred_optim(strategy)

    def remove_checkpoint(filepath: Any) -> None:
        if binding.remove(filepath, strategy):
            return
        # not our pointer: the strategy removes it through its checkpoint_io, this plugin, which
        # then removes the file as Lightning's TorchCheckpointIO would (instead of coming back here)
        binding.foreign_removal = True
        try:
            orig_remove(filepath)
        finally:
            binding.foreign_removal = False

    @functools.wraps(orig_teardown)
    def teardown() -> None:
        trainer = st.trainer(strategy)  # still "running" at the teardown of a normal end only
        normal = trainer is not None and trainer.state.status.value == "running"
        try:
            orig_teardown()
        finally:
            plugin.wait()
        if normal:  # every rank is here: a collective is safe
            binding.finish(strategy)

    def on_train_start() -> None:
        trainer = st.trainer(strategy)  # global_step: the resumed step, or the previous fit's
        if trainer is not None:
            check_start(
                plugin.manager(),
                int(trainer.global_step),
                "shardkeeper.lightning",
                resume=f"trainer.fit(..., ckpt_path={plugin.root!r}), or ckpt_path='last' after a save_last",
                elsewhere="ShardkeeperCheckpointIO(<another root>)",
                resumed=trainer.ckpt_path is not None,
            )
        orig_train_start()

    def on_train_batch_start(batch: Any, batch_idx: int, *args: Any) -> None:
        binding.data.advance(st.trainer(strategy))
        orig_batch_start(batch, batch_idx, *args)

    return {
        "save_checkpoint": save_checkpoint,
        "load_checkpoint": load_checkpoint,
        "load_model_state_dict": load_model_state_dict,
        "load_optimizer_state_dict": load_optimizer_state_dict,
        "lightning_module_state_dict": lambda: {},
        "optimizer_state": lambda optimizer: {},
        "remove_checkpoint": remove_checkpoint,
        "teardown": teardown,
        "on_train_start": on_train_start,
        "on_train_batch_start": on_train_batch_start,
    }


def disconnect(plugin: ShardkeeperCheckpointIO) -> None:
    """Wait for the plugin's save in flight, then give its strategy its own methods back, and
    Lightning's own ``TorchCheckpointIO`` in place of the plugin (so the strategy saves natively)."""
    strategy = plugin.strategy
    try:
        plugin.wait()
    finally:
        plugin.binding.patches.restore()
        plugin.strategy = None
        if strategy is not None and strategy.checkpoint_io is plugin:
            from lightning.fabric.plugins import TorchCheckpointIO

            strategy.checkpoint_io = TorchCheckpointIO()


def install() -> None:
    """Extend ``Strategy.checkpoint_io``'s setter and wrap the ``.ckpt`` loader, once (see the
    module docstring)."""
    prop = Strategy.__dict__["checkpoint_io"]
    if installed():
        return
    fset = prop.fset

    def setter(self: Any, io: Any) -> None:
        fset(self, io)
        if isinstance(io, ShardkeeperCheckpointIO):
            connect(io, self)

    INSTALLED.set(Strategy, "checkpoint_io", property(prop.fget, setter, prop.fdel, prop.__doc__))
    hook_loaders(INSTALLED)
    _hook_sampler_resolver()


def _hook_sampler_resolver() -> None:
    """Under a connected plugin, the sampler Lightning resolves for a train DataLoader is the
    plugin's (``binding.data.replace``); other Trainers get Lightning's own."""
    cls, name = li.sampler_resolver()
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def resolve(self: Any, dataloader: Any, shuffle: bool, mode: Any = None) -> Any:
        sampler = orig(self, dataloader, shuffle, mode)
        trainer = self.trainer
        plugin = getattr(trainer.strategy, "_shardkeeper_plugin", None)
        if not isinstance(plugin, ShardkeeperCheckpointIO):
            return sampler
        return plugin.binding.data.replace(trainer, dataloader, sampler, mode)

    INSTALLED.set(cls, name, resolve)


def uninstall() -> None:
    """Give ``Strategy.checkpoint_io`` its own setter and Lightning its own ``.ckpt`` loader
    and sampler resolution back: plugins set from now on are plain ``CheckpointIO`` objects to Lightning (connected
    strategies stay so until ``disconnect``), and pointer files load only through
    :func:`shardkeeper.lightning.load_checkpoint`."""
    INSTALLED.restore()


__all__ = ["connect", "disconnect", "install", "installed", "uninstall"]
