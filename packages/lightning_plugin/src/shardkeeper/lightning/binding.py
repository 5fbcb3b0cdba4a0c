"""``plugin.binding``: the plugin's side of the strategy it is connected to.

Lightning's sharded strategies never call their ``CheckpointIO`` for sharded state, and the
others call it on rank 0 only; so the hook (:mod:`shardkeeper.lightning.hook`) replaces the
strategy's checkpoint methods on every rank, each calling one public method of the plugin's
:class:`StrategyBinding`: ``save`` (one collective shardkeeper save per Lightning save),
``load``, ``restore_deferred_optim``, ``remove``, ``finish``. The binding holds what they share
with the plugin: the root's manager, this process's saves, the pointers due (written once
their step is committed, :mod:`shardkeeper.lightning.pointers`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from shardkeeper.core import CheckpointManager, RNGState
from shardkeeper.core.adapter import Manifest, Patches, check_save_step, framework_of, progress_state, read_progress
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.lightning import codec
from shardkeeper.lightning import strategy as st
from shardkeeper.lightning._loops import fit_loop_at
from shardkeeper.lightning.data import DataPositions
from shardkeeper.lightning.loading import lightning_dict
from shardkeeper.lightning.paths import (
    PathIndex,
    Target,
    norm_path,
    pointed_step,
    read_pointer,
    remove_pointer,
    resolve,
)
from shardkeeper.lightning.pointers import DuePointers

log = logging.getLogger(__name__)

#: The framework name in the manifest metadata and under ``progress/``.
FRAMEWORK = "lightning"
#: Marks a checkpoint dict this plugin returned from ``load_checkpoint``.
MARK = "_shardkeeper"


class PluginSettings(Protocol):
    """What a binding reads off its plugin, at each use."""

    root: str
    restore_rng: bool
    manager_options: dict[str, Any]
    strategy: Any


class StrategyBinding:
    """A plugin's checkpoints of its root, as the strategy it is connected to takes them."""

    def __init__(self, plugin: PluginSettings) -> None:
        self.plugin = plugin
        self.patches = Patches()  # the plugin's patches of its strategy (hook.connect)
        self.foreign_removal = False  # the strategy is removing a path that is not one of ours
        self._mgr: CheckpointManager | None = None
        self._index: PathIndex | None = None
        self._saved: dict[int, bool] = {}  # steps this process saved -> weights_only
        self._handle: Any = None
        self._deferred_optim: tuple[CheckpointManager, int] | None = None
        self._resumed: int | None = None  # the step of this root this run resumed from
        self._pointers = DuePointers(plugin.root, self._path_index)  # rank 0: written on commit
        self.data = DataPositions()  # the train samplers' positions (data.py)

    def finish(self, strategy: Any) -> None:
        """After ``fit()``'s teardown waited for the last save, on every rank (a normal end):
        rank 0 writes the pointers still due, and every rank returns once they are written (a
        rank reading ``last.ckpt`` after ``fit()`` finds it) or raises rank 0's failure."""
        failed = self._pointers.settle(self._handle) if self._mgr is not None and self._mgr.rank == 0 else None
        failed = strategy.broadcast(failed)
        if failed is not None:
            raise CheckpointError(f"{failed} (rank 0); the steps themselves are committed")

    def manager(self) -> CheckpointManager:
        """The manager of the root (created on first use: a collective on every rank)."""
        if self._mgr is None:
            import lightning

            p = self.plugin
            more = {"lightning_strategy": type(p.strategy).__name__} if p.strategy is not None else {}
            self._mgr = st.root_managers(FRAMEWORK, lightning.__version__, p.manager_options, **more).get(p.root)
        return self._mgr

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and its paths point at it;
        raise its failure (its paths then keep what they named). A failure to write a pointer
        is logged here (rank 0 alone must not raise), and raised by the next save."""
        if self._mgr is None:
            return
        try:
            self._mgr.wait()
        finally:
            failed = self._pointers.settle(self._handle) if self._mgr.rank == 0 else None
            if failed is not None:
                log.warning("%s (retried at the next save)", failed)

    def close(self) -> None:
        if self._mgr is not None:
            try:
                self.wait()
            finally:
                self._mgr.close()
                self._mgr = None

    # -- save ----------------------------------------------------------------------------------
    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not used by "
                "ShardkeeperCheckpointIO: give storage options to the plugin "
                "(ShardkeeperCheckpointIO(root, storage_options={...}))"
            )
        path = norm_path(strategy.broadcast(norm_path(filepath)))
        step = int(checkpoint.get("global_step", 0))
        weights_only = "optimizer_states" not in checkpoint
        mgr = self.manager()
        trainer = st.trainer(strategy)
        known = self._saved.get(step)
        if known is None:
            check = check_save_step(mgr, step)  # rank 0's answer on every rank
            if check.committed and step == self._resumed:
                self._pointers.committed(step)
                # ModelCheckpoint saving again at the step this run resumed from: that state
                log.warning(
                    "step %d is the committed step this run resumed from under %s; %s now names "
                    "that checkpoint, which is kept as it is",
                    step,
                    self.plugin.root,
                    path,
                )
                known = weights_only
            else:
                check.raise_if_refused(
                    f"Lightning save at global_step {step} ({path})",
                    "Trainer.fit(..., ckpt_path=<the root>) resumes the step count from the root.",
                )
        if known is not None:
            if known and not weights_only:
                raise ValueError(
                    f"{path}: step {step} is already saved under {self.plugin.root} with weights only; a "
                    f"full checkpoint of the same step cannot be written beside it. Save the full "
                    f"checkpoint first, or at another step"
                )
        else:
            state = self._state(strategy, checkpoint, weights_only)
            running = trainer is not None and trainer.state.status.value == "running"
            previous = self._handle
            self._handle = mgr.save(step, state, async_save=None if running else False)
            self._saved[step] = weights_only
            if mgr.rank == 0:
                self._pointers.watch(self._handle)
                self._pointers.settle(previous)  # ended: save() waited for it (and raised its failure)
        failed = None
        if mgr.rank == 0:  # the pointer is written once the step is committed (now, if it is)
            self._pointers.add(path, step)
            failed = self._pointers.settle(self._handle)
        self._delete_orphans(strategy, failed)

    def _state(self, strategy: Any, ck: dict[str, Any], weights_only: bool) -> dict[str, Any]:
        engine = st.engine_state(strategy)  # DeepSpeed: the adapter's model/optim/progress(/sched)
        state: dict[str, Any] = {}
        opts = [] if weights_only else list(strategy.optimizers)
        scheds = [] if weights_only else list(ck.get("lr_schedulers", []))
        if opts and engine is None:
            state["optim"] = opts[0] if len(opts) == 1 else {str(i): o for i, o in enumerate(opts)}
        lsched = None
        if scheds:
            enc = [codec.encode(s, f"lr_schedulers/{i}") for i, s in enumerate(scheds)]
            lsched = enc[0] if len(enc) == 1 else {str(i): s for i, s in enumerate(enc)}
        ours: dict[str, Any] = {"loops": codec.encode(ck["loops"], "loops")} if "loops" in ck else {}
        progress = progress_state(
            step=int(ck.get("global_step", 0)), epoch=int(ck.get("epoch", 0)), counters={FRAMEWORK: ours}
        )
        info: dict[str, Any] = {
            "version": str(ck.get("pytorch-lightning_version", "")),
            "weights_only": weights_only,
            "optimizers": len(opts),
            "schedulers": len(scheds),
            "strategy": type(strategy).__name__,
        }
        state["progress"] = progress
        if engine is None:
            if lsched is not None:
                state["sched"] = lsched
        else:
            if lsched is not None and "sched" in engine:  # the engine steps its own scheduler
                info["sched"] = lsched
            elif lsched is not None:
                state["sched"] = lsched
        extra: dict[str, Any] = {"lightning": info}
        if "callbacks" in ck:
            extra["callbacks"] = codec.encode(ck["callbacks"], "callbacks")
        rest = codec.encode_rest(ck, skip=(MARK,), where="checkpoint", stacklevel=3)
        if rest:
            extra["checkpoint"] = rest
        state["extra"] = extra
        # Callback, loop and scheduler state can differ between ranks (an EarlyStopping score
        # of a rank's own loss); Lightning keeps rank 0's, and so does the plugin: the core
        # would write a plain tensor from whichever rank it picks for a replicated tensor.
        shared = strategy.broadcast({k: state[k] for k in ("sched", "progress", "extra") if k in state})
        state.update(shared)
        if engine is None:
            state["model"] = st.model(strategy)
        else:
            state["model"] = engine["model"]
            # one progress entry: the engine's counters beside Lightning's, the step Lightning's
            state["progress"] = {**engine["progress"].state_dict(), **state["progress"]}
            if opts:
                state["optim"] = engine["optim"]
            if "sched" in engine and not weights_only:
                state["sched"] = engine["sched"]
        state["rng"] = RNGState()
        if not weights_only:
            self.data.add_to(state, st.trainer(strategy))  # extra/data_position/<i>
        return state

    # -- load ----------------------------------------------------------------------------------
    def _resolve(self, strategy: Any, ckpt_path: Any) -> Target:
        def find() -> Target:
            target = resolve(ckpt_path, self.plugin.root)
            if target is None:
                raise CheckpointNotFoundError(st.not_ours(ckpt_path, self.plugin.root))
            return target

        target: Target = st.on_rank0(strategy, find)
        return target

    def load(self, strategy: Any, ckpt_path: Any) -> dict[str, Any]:
        target = self._resolve(strategy, ckpt_path)
        own = target.root == self.plugin.root
        mgr = self.manager() if own else st.reading_manager(target.root, self.plugin.manager_options)
        try:
            step = target.step
            if own and self._handle is not None and (step is None or step == self._handle.step):
                self.wait()  # a save of this process still in flight: let it commit first
            step = st.on_rank0(strategy, lambda: pointed_step(target, mgr))  # a pointer's uncommitted step: below
            if step is None:
                step = strategy.broadcast(mgr.latest_step())
                if step is None:
                    raise CheckpointNotFoundError(
                        f"no committed checkpoint under {target.root} (rank {mgr.rank}); nothing to "
                        f"resume from. Check the root, or start without ckpt_path"
                    )
            ck = self._restore(strategy, mgr, step, mgr.manifest(step))
            if own:
                self._resumed = step
            return ck
        finally:
            if not own and self._deferred_optim is None:
                mgr.close()

    def _restore(self, strategy: Any, mgr: CheckpointManager, step: int, manifest: Manifest) -> dict[str, Any]:
        leaves = manifest.leaves
        lm = strategy.lightning_module
        trainer = st.trainer(strategy)
        fitting = trainer is not None and trainer.state.fn.value == "fit"
        engine = st.engine_state(strategy)
        state: dict[str, Any] = {"model": st.model(strategy) if engine is None else engine["model"]}
        only = ["model/*"]
        optional: list[str] = []
        if engine is not None:  # the engine's counters, from any checkpoint's progress
            state["progress"] = engine["progress"]
            only.append("progress/*")
        for ns in ("sched", "extra"):
            sk = codec.skeleton(leaves, ns)
            if sk is not None:
                state[ns] = sk
                only.append(f"{ns}/*")
        has_optim = any(k.startswith("optim/") for k in leaves)
        n_opt = st.count(leaves, "optim", "param_groups")
        self._deferred_optim = None
        if fitting and has_optim and engine is not None:
            state["optim"] = engine["optim"]
            only.append("optim/*")
        elif fitting and has_optim:
            if strategy.restore_checkpoint_after_setup and strategy.optimizers:
                state["optim"] = st.optim_target(list(strategy.optimizers), n_opt, mgr, step)
                only.append("optim/*")
            else:  # the optimizers do not exist yet: load_optimizer_state_dict() restores them
                self._deferred_optim = (mgr, step)
        if self.plugin.restore_rng and any(k.startswith("rng/") for k in leaves):
            state["rng"] = RNGState()
            only.append("rng/*")
        strict = bool(getattr(lm, "strict_loading", True))
        mgr.restore(state, step=step, only=only, strict=strict, optional=optional)
        positions = (state.get("extra") or {}).get("data_position") if fitting else None
        self.data.resume(positions)  # extra/data_position/<i>, for the train samplers
        extra = codec.decode(state.get("extra") or {})
        ck = lightning_dict(manifest, extra, state.get("sched"), step, mgr.storage.url)
        ck["state_dict"] = {}
        ck[MARK] = {"root": mgr.storage.url, "step": step}
        if "loops" not in ck and fitting and trainer is not None:
            # another framework's checkpoint: resume its step count
            progress = read_progress(manifest)
            ck["loops"] = {"fit_loop": fit_loop_at(trainer, step=progress.step, epoch=progress.epoch)}
        if has_optim:
            ck["optimizer_states"] = []
        return ck

    def restore_deferred_optim(self, strategy: Any) -> None:
        if self._deferred_optim is None:
            return
        mgr, step = self._deferred_optim
        self._deferred_optim = None
        leaves = mgr.manifest(step).leaves
        opts = list(strategy.optimizers)
        state = {
            "model": st.model(strategy),
            "optim": st.optim_target(opts, st.count(leaves, "optim", "param_groups"), mgr, step),
        }
        mgr.restore(state, step=step, only=["optim/*"])
        if mgr is not self._mgr:
            mgr.close()

    # -- remove / retention ----------------------------------------------------------------
    def remove(self, filepath: Any, strategy: Any) -> bool:
        """Remove a pointer (rank 0); its step goes once no path names it (every rank: the
        deletion is collective). False: not one of our pointers."""
        path = norm_path(filepath)
        ours = None
        if st.rank(strategy) == 0:
            failed = self._pointers.settle()
            if failed is not None:
                log.warning("%s (retried at the next save)", failed)
            waiting = self._pointers.take(path)  # due, so never written: its step had not committed
            with self._pointers.lock:  # (the path index: a save's done-callback updates it too)
                try:
                    target = read_pointer(path)
                except CheckpointError as e:  # a damaged pointer: remove the path Lightning removes
                    log.warning("removing %s, a damaged shardkeeper pointer: %s", path, e)
                    remove_pointer(path)
                    target, ours = None, self._path_index().drop(path) is not None  # its step may go
                    self._path_index().flush()
                if target is not None:
                    remove_pointer(path)
                    ours = target.root == self.plugin.root
                    if ours:
                        idx = self._path_index()
                        idx.drop(path)
                        idx.flush()
            ours = True if waiting and ours is None else ours
        ours = strategy.broadcast(ours)
        if ours is None:
            return False
        if ours:
            self._delete_orphans(strategy)
        return True

    def _ours(self, mgr: CheckpointManager, step: int, idx: PathIndex) -> bool:
        """Whether ModelCheckpoint's retention may delete ``step``: only a step the Lightning
        plugin wrote (this run or an earlier one); a step another framework or a plain core
        save committed stays, and is forgotten as an orphan."""
        if step in self._saved:
            return True
        try:
            ours = framework_of(mgr.manifest(step)) == FRAMEWORK
        except CheckpointNotFoundError:
            ours = False  # gone already
        if not ours:
            idx.orphans.discard(step)
            log.info(
                "step %d under %s was not written by the Lightning plugin: retention keeps it", step, self.plugin.root
            )
        return ours

    def _path_index(self) -> PathIndex:
        if self._index is None:
            self._index = PathIndex(self.manager().storage)
        return self._index

    def _delete_orphans(self, strategy: Any, failed: str | None = None) -> None:
        """Delete steps no path names, through ``mgr.delete`` (a collective: never the newest
        committed step, nor one in flight; those stay orphans and are retried later).
        ``failed``: rank 0's failure to write pointers, raised here on every rank."""
        mgr = self.manager()
        doomed: list[int] = []
        if mgr.rank == 0:
            with self._pointers.lock:
                idx = self._path_index()
                doomed = sorted(s for s in list(idx.orphans) if not idx.named(s) and self._ours(mgr, s, idx))
        doomed, failed = strategy.broadcast((doomed, failed))
        if failed is not None:
            raise CheckpointError(f"{failed} (rank 0); the steps themselves are committed")
        if not doomed:
            return
        gone = {s for s in doomed if mgr.delete(s)}
        if mgr.rank == 0:
            with self._pointers.lock:
                idx = self._path_index()
                idx.orphans = {s for s in idx.orphans if s not in gone and not idx.named(s)}
                idx.flush()


__all__ = ["FRAMEWORK", "MARK", "PluginSettings", "StrategyBinding"]
