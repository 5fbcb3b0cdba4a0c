"""A DeepSpeed ZeRO engine as shardkeeper's canonical state (the canonical keys: docs/format.md, 3.3).

``engine_state(engine)`` returns ``{"model", "optim", "sched", "progress"}`` entries for a
``CheckpointManager.save`` / ``restore`` state dict:

- ``model/<fqn>``: the fp32 master weights, as ``Fragment``s of each parameter's global
  tensor (this rank's slice of the flat ZeRO partition, padding excluded); frozen parameters
  and persistent buffers as they are;
- ``optim/state/<fqn>/<name>``: flat-shaped optimizer state (``exp_avg``, ``exp_avg_sq``, ...)
  as fragments the same way; scalar state (``step``) once per parameter, as torch keeps it;
- ``optim/param_groups``: the base optimizer's hyperparameters, params listed by FQN, shaped
  like ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``'s output, so a
  plain-torch / FSDP2 checkpoint restores into the engine and the reverse;
- ``sched``: the engine's LR scheduler; ``progress``: global steps and samples, skipped
  steps, micro steps, the loss scaler.

Each entry is an object with ``state_dict()`` / ``load_state_dict()``: the core fills the
fragments in place, then ``load_state_dict`` pushes fp32 -> low-precision parameters and
relinks what DeepSpeed derives from the optimizer state.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardkeeper.core import Fragment, StateMismatchError, normalize_fqn
from shardkeeper.core.adapter import Progress, ProgressTarget, progress_state
from shardkeeper.deepspeed import _ds_internals as dsi


def _param_names(engine: Any) -> dict[int, str]:
    return {id(p): normalize_fqn(n) for n, p in engine.module.named_parameters()}


#: The framework name in the manifest metadata and under ``progress/``.
FRAMEWORK = "deepspeed"


def ensure_optimizer_state(engine: Any) -> None:
    """Create optimizer state torch creates lazily at the first step, as a fresh optimizer's.

    Runs the base optimizer once on zero gradients with lr 0 (as torch's
    ``get_optimizer_state_dict`` does), puts the parameters back, then zeroes the new state
    (``step`` 0, moments 0): the next real step behaves exactly as a first step. Needed
    before a restore (the targets must exist) and for saving an engine that never stepped.
    """
    groups = dsi.flat_groups(engine)
    base = engine.optimizer.optimizer
    empty = [g.flat for g in groups if not base.state.get(g.flat)]
    if not empty:
        return
    with torch.no_grad():
        saved = [(g.flat, g.flat.detach().clone(), g.flat.grad) for g in groups]
        for g in groups:
            g.flat.grad = torch.zeros_like(g.flat)
        lrs = [grp.get("lr") for grp in base.param_groups]
        # ZeRO-3 empties each group's params between steps and sets them per sub-group for
        # its step; set them to the group's flat partitions for this one step.
        params = [grp["params"] for grp in base.param_groups]
        for gi, grp in enumerate(base.param_groups):
            grp["params"] = [g.flat for g in groups if g.group_index == gi]
            if "lr" in grp:
                grp["lr"] = torch.tensor(0.0) if isinstance(grp["lr"], torch.Tensor) else 0.0
        try:
            base.step()
        finally:
            for grp, lr, ps in zip(base.param_groups, lrs, params):
                grp["params"] = ps
                if lr is not None:
                    grp["lr"] = lr
            for flat, data, grad in saved:
                flat.copy_(data)
                flat.grad = grad
        for flat in empty:
            for v in base.state.get(flat, {}).values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
    dsi.relink_optimizer_fragments(engine)


class ModelState:
    """``model/<fqn>``: fp32 master-weight fragments; frozen parameters and buffers as they are."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: leave parameters with requires_grad=False out (save_checkpoint's exclude_frozen_parameters)
        self.exclude_frozen = False
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def state_dict(self) -> dict[str, Any]:
        engine = self.engine
        self._casts = []
        groups = dsi.flat_groups(engine)
        by_id = {id(s.param): s for s in dsi.param_slices(engine, groups)}
        frozen3 = {id(p): (off, n) for _, p, off, n in dsi.frozen_zero3_partitions(engine)}
        out: dict[str, Any] = {}
        for name, p in engine.module.named_parameters():
            s = by_id.get(id(p))
            if s is None and self.exclude_frozen and not p.requires_grad:
                continue
            if s is not None:
                local = groups[s.flat_group].flat.detach().narrow(0, s.start, s.numel)
                out[normalize_fqn(name)] = Fragment(local, s.shape, s.offset, partition=s.partition)
            elif id(p) in frozen3:
                off, n = frozen3[id(p)]
                local = self._fp32(p.ds_tensor.detach().view(-1).narrow(0, 0, n))
                out[normalize_fqn(name)] = Fragment(local, tuple(p.ds_shape), off)
            else:
                out[normalize_fqn(name)] = self._fp32(p.data)
        for name, buf in dsi.persistent_buffers(engine.module).items():
            out[normalize_fqn(name)] = self._fp32(buf)
        return out

    def _fp32(self, t: torch.Tensor) -> torch.Tensor:
        """Low-precision tensors without an fp32 master (buffers, frozen parameters: DeepSpeed
        casts them with the module) are stored as fp32, like the masters, so every framework
        reads fp32 ``model/*``; the restore casts back into the engine's own tensor."""
        if t.dtype not in (torch.bfloat16, torch.float16):
            return t
        copy = t.detach().float()
        self._casts.append((copy, t))
        return copy

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # The fragments were filled in place: push fp32 masters into the module's weights.
        with torch.no_grad():
            for copy, own in self._casts:
                own.copy_(copy)
        dsi.push_master_weights(self.engine)
        if dsi.zero_stage(self.engine) == 3:
            dsi.regather_zero3(self.engine, [p for _, p, _, _ in dsi.frozen_zero3_partitions(self.engine)])


class OptimState:
    """``optim/state/<fqn>/<name>`` and ``optim/param_groups`` of the engine's base optimizer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def shardkeeper_optimizers(self) -> list[Any]:
        """The torch optimizer whose ``step()`` mutates the saved fp32 partitions and moments
        (``shardkeeper.core.adapter.OptimizerHolder``): with ``staging="overlap"`` the core
        gates it on the background copy (the engine calls it from ``engine.step()``)."""
        return [self.engine.optimizer.optimizer]

    def _layout(self) -> tuple[list[dsi.FlatGroup], list[dsi.ParamSlice]]:
        groups = dsi.flat_groups(self.engine)
        return groups, dsi.param_slices(self.engine, groups)

    def param_groups(self) -> list[dict[str, Any]]:
        names = _param_names(self.engine)
        groups, _ = self._layout()
        base = self.engine.optimizer.optimizer
        out = []
        for gi, grp in enumerate(base.param_groups):
            fqns = [names[id(p)] for g in groups if g.group_index == gi for p in g.params]
            out.append({**{k: v for k, v in grp.items() if k != "params"}, "params": fqns})
        return out

    def state_dict(self) -> dict[str, Any]:
        ensure_optimizer_state(self.engine)
        names = _param_names(self.engine)
        groups, slices = self._layout()
        base = self.engine.optimizer.optimizer
        state: dict[str, dict[str, Any]] = {}
        for s in slices:
            flat = groups[s.flat_group].flat
            per: dict[str, Any] = {}
            for k, v in base.state.get(flat, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == flat.shape:
                    per[k] = Fragment(v.detach().narrow(0, s.start, s.numel), s.shape, s.offset, partition=s.partition)
                elif isinstance(v, torch.Tensor):
                    per[k] = v.detach().clone()  # scalar state (step): one copy per parameter
                else:
                    per[k] = v
            state[names[id(s.param)]] = per
        return {"state": state, "param_groups": self.param_groups()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        names = _param_names(self.engine)
        groups, slices = self._layout()
        base = self.engine.optimizer.optimizer
        self._load_param_groups(sd.get("param_groups"), base)
        # Scalar state is per flat partition in ZeRO: take it from the partition's first
        # parameter, and say so if the checkpoint's parameters disagree.
        done: set[int] = set()
        for s in slices:
            flat = groups[s.flat_group].flat
            per = sd["state"].get(names[id(s.param)], {})
            target = base.state.setdefault(flat, {})
            for k, v in per.items():
                if isinstance(v, Fragment):
                    continue
                if id(flat) in done:
                    cur = target.get(k)
                    same = (
                        torch.equal(cur, v)
                        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor)
                        else cur == v
                    )
                    if not same:
                        warnings.warn(
                            f"optimizer state {k!r} of {names[id(s.param)]} differs from that of "
                            f"the other parameters in its ZeRO partition; DeepSpeed keeps one value "
                            f"per partition, the first parameter's is used",
                            stacklevel=2,
                        )
                    continue
                cur = target.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                    cur.copy_(v)
                else:
                    target[k] = v
            done.add(id(flat))
        dsi.relink_optimizer_fragments(self.engine)

    def _load_param_groups(self, saved: Any, base: torch.optim.Optimizer) -> None:
        if saved is None:
            return
        current = self.param_groups()
        # Frozen parameters: torch lists them in their group, ZeRO leaves them out; ignore them.
        frozen = {normalize_fqn(n) for n, p in self.engine.module.named_parameters() if not p.requires_grad}
        if len(saved) != len(current) or any(
            set(s.get("params", [])) - frozen != set(c["params"]) for s, c in zip(saved, current)
        ):
            raise StateMismatchError(
                "the checkpoint's optimizer param_groups do not match the engine's: saved "
                f"{[sorted(g.get('params', [])) for g in saved]}, engine "
                f"{[sorted(g['params']) for g in current]}; build the optimizer with the same "
                "parameter groups, or restore without the optimizer (only=['model/*'])"
            )
        for s, grp in zip(saved, base.param_groups):
            for k, v in s.items():
                if k != "params":
                    grp[k] = tuple(v) if isinstance(grp.get(k), tuple) and isinstance(v, list) else v


class ProgressState(ProgressTarget):
    """``progress/...``: the shared step and samples, and the engine's own counters and loss
    scaler under ``progress/deepspeed/`` (the core's progress schema)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        counters = {
            "global_step": int(e.global_steps),
            "global_samples": int(e.global_samples),
            "skipped_steps": int(e.skipped_steps),
            "micro_steps": int(e.micro_steps),
            "loss_scaler": dsi.loss_scaler_state(e),
        }
        return progress_state(step=int(e.global_steps), samples=int(e.global_samples), counters={FRAMEWORK: counters})

    def load_progress(self, progress: Progress) -> None:
        """The engine's counters: its own where it wrote them, else the step count of the
        checkpoint another framework wrote (samples: as counted there, or the engine's batch
        size times the steps, which is what the engine counts for a constant batch size)."""
        e = self.engine
        own = progress.of(FRAMEWORK)
        if own:
            e.global_steps = progress.count(FRAMEWORK, "global_step", progress.step)
            e.global_samples = progress.count(FRAMEWORK, "global_samples", int(e.global_samples))
            e.skipped_steps = progress.count(FRAMEWORK, "skipped_steps", int(e.skipped_steps))
            e.micro_steps = progress.count(FRAMEWORK, "micro_steps", int(e.micro_steps))
            dsi.set_loss_scaler_state(e, dict(own.get("loss_scaler") or {}))
            return
        e.global_steps = int(progress.step)
        e.global_samples = int(
            progress.samples if progress.samples is not None else progress.step * e.train_batch_size()
        )
        e.micro_steps = int(progress.step * e.gradient_accumulation_steps())


def engine_state(engine: Any) -> dict[str, Any]:
    """The canonical state of a DeepSpeed ZeRO-1/2/3 engine, for ``mgr.save`` / ``mgr.restore``.

    Use it as is (``mgr.save(step, engine_state(engine))``) or next to other entries
    (``{**engine_state(engine), "rng": RNGState()}``). Creates lazily initialized optimizer
    state if the engine has not stepped yet (see ``ensure_optimizer_state``).
    """
    dsi.require_engine(engine)
    dsi.warn_if_untested()
    ensure_optimizer_state(engine)
    state: dict[str, Any] = {"model": ModelState(engine), "optim": OptimState(engine)}
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and hasattr(sched, "state_dict") and hasattr(sched, "load_state_dict"):
        state["sched"] = sched
    state["progress"] = ProgressState(engine)
    return state


__all__ = ["ModelState", "OptimState", "ProgressState", "engine_state", "ensure_optimizer_state"]
