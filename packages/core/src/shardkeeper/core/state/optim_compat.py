"""Is a checkpoint's optimizer state of the same kind as the target's optimizer?

Restoring an optimizer replaces its param groups with the saved ones and fills its state
tensors by name, so AdamW's state restored into SGD would leave SGD with AdamW's
hyper-parameters (its first ``step()`` then fails inside torch, or trains wrongly). The save
records each optimizer's class in the manifest's metadata (``metadata.optimizer_classes``, by state
key). A restore refuses, before reading any data:

- when the checkpoint records the class: if the class names differ (the same class saved by
  another torch version passes, whatever its param groups hold: the optimizer's
  ``__setstate__`` fills the defaults of hyper-parameters it added);
- when it does not (a checkpoint written before the record, or by another writer): if the
  saved param groups lack hyper-parameters the target's have *and* have some the target's
  lack, or likewise a parameter's state names (``exp_avg`` against ``momentum_buffer``) where
  the target has state for it. Names missing on one side only are version skew and pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardkeeper.core.errors import StateMismatchError

#: The manifest metadata member naming each optimizer's class, by the optimizer's state key.
METADATA_KEY = "optimizer_classes"


@dataclass(frozen=True)
class OptimizerTarget:
    """What a restore target's optimizer is: its class, the hyper-parameter names of its
    param groups, the state names of each parameter that has state, the state key of the
    module that owns its parameters (for the remedy), how many param groups it has, and the
    parameter FQNs of each group (all, and those that require grad)."""

    cls: str
    group_keys: frozenset[str]
    state_names: Mapping[str, frozenset[str]]
    owner: str | None
    groups: int | None = None
    params: tuple[frozenset[str], ...] | None = None
    #: each group's parameters that require grad (a frozen one may have no saved state)
    trainable: tuple[frozenset[str], ...] | None = None


def _innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside wrappers that keep it as ``.optimizer`` (Accelerate, Lightning)."""
    seen = {id(opt)}
    inner = getattr(opt, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and id(inner) not in seen:
        opt, inner = inner, getattr(inner, "optimizer", None)
        seen.add(id(opt))
    return opt


def optimizer_class(opt: torch.optim.Optimizer) -> str:
    cls = type(_innermost(opt))
    return f"{cls.__module__}.{cls.__qualname__}"


#: Value types that hold no optimizer: skipped by type alone (``save()`` calls this on the
#: caller's thread, and a state may hold 10,000s of plain tensors).
_NO_OPTIMIZER = frozenset((torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes, type(None)))


def optimizer_classes(state: Mapping[str, Any]) -> dict[str, str]:
    """The class of every optimizer in ``state``, by the key it is flattened under (dicts,
    lists and tuples recurse as in ``state/flatten.py``)."""
    out: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in state.items()]
    skip = _NO_OPTIMIZER
    while stack:
        key, v = stack.pop()
        if isinstance(v, torch.optim.Optimizer):
            out[key] = optimizer_class(v)
        elif isinstance(v, Mapping):
            if not skip.issuperset(map(type, v.values())):  # one pass in C over a dict of tensors
                stack.extend([(f"{key}/{k}", x) for k, x in v.items() if type(x) not in skip])
        elif isinstance(v, (list, tuple)):
            if not skip.issuperset(map(type, v)):
                stack.extend([(f"{key}/{i}", x) for i, x in enumerate(v) if type(x) not in skip])
    return out


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


def _group_keys(groups: Any) -> frozenset[str] | None:
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return None
    return frozenset(k for g in groups for k in g if k != "params")


def _state_pairs(leaves: Mapping[str, Any], prefix: str, t: OptimizerTarget) -> list[tuple[set[str], frozenset[str]]]:
    """(saved, target) state names of each parameter both sides hold state for: one scan of
    the manifest's keys under ``prefix`` (``<key>/state/<fqn>/<name>...``)."""
    if not t.state_names:
        return []
    saved: dict[str, set[str]] = {}
    for k in leaves:
        if k.startswith(prefix):
            fqn, _, rest = k[len(prefix) :].partition("/")
            saved.setdefault(fqn, set()).add(rest.split("/", 1)[0])
    return [(saved[f], names) for f, names in t.state_names.items() if saved.get(f)]


def _both_ways(saved: frozenset[str] | set[str], target: frozenset[str] | set[str]) -> bool:
    return bool(saved - target) and bool(target - saved)


def check_optimizers(
    targets: Mapping[str, OptimizerTarget], manifest: Any, restores: Callable[[str], bool], where: str
) -> None:
    """Raise a ``StateMismatchError`` naming the state key, both classes where known, the
    differing names and the remedy, for the first optimizer of ``targets`` (restored, as
    ``restores`` says of its keys) whose saved state is of another kind."""
    recorded = manifest.metadata.get(METADATA_KEY)
    classes = recorded if isinstance(recorded, Mapping) else {}
    for key, t in targets.items():
        groups_key, prefix = f"{key}/param_groups", f"{key}/state/"
        if not restores(groups_key) and not any(
            restores(f"{prefix}{fqn}/{n}") for fqn, names in t.state_names.items() for n in names
        ):
            continue
        saved_cls = classes.get(key) if isinstance(classes.get(key), str) else None
        rec = manifest.leaves.get(groups_key)
        saved_keys = _group_keys(rec.value) if rec is not None and rec.kind == "object" else None
        if restores(groups_key) and rec is not None and rec.kind == "object":
            _check_group_count(key, rec.value, t, where)
            _check_group_params(key, rec.value, t, where, functools.partial(_stateful, manifest.leaves, prefix))
        if saved_cls is not None:
            differs = _short(saved_cls) != _short(t.cls)
        else:
            differs = (saved_keys is not None and _both_ways(saved_keys, t.group_keys)) or any(
                _both_ways(s, names) for s, names in _state_pairs(manifest.leaves, prefix, t)
            )
        if not differs:
            continue
        pairs = _state_pairs(manifest.leaves, prefix, t)
        details = []
        if saved_keys is not None and saved_keys != t.group_keys:
            details.append(
                f"param groups: the checkpoint's have {sorted(saved_keys - t.group_keys)}, which the "
                f"target's lack, and lack {sorted(t.group_keys - saved_keys)}, which the target's have"
            )
        if pairs:
            s_names = sorted(set().union(*(s for s, _ in pairs)))
            t_names = sorted(set().union(*(n for _, n in pairs)))
            if s_names != t_names:
                details.append(f"per-parameter state: the checkpoint has {s_names}, the target {t_names}")
        saved = saved_cls or "an optimizer of another kind (its class is not recorded)"
        same = f"the same optimizer class as was saved ({_short(saved_cls)})" if saved_cls else "the saved optimizer"
        only = f"only=[{(t.owner or 'model') + '/*'!r}]"
        raise StateMismatchError(
            f"the optimizer at state key {key!r} in {where} was saved as {saved}, the target is "
            f"{t.cls}{': ' + '; '.join(details) if details else ''}. Restoring it would give the "
            f"target another optimizer's hyper-parameters and state; nothing was read. Build "
            f"{same}, or restore the model without the optimizer: {only}"
        )


def _check_group_count(key: str, saved: Any, t: OptimizerTarget, where: str) -> None:
    """A checkpoint's param groups land on the target's one by one: another number of them
    would leave groups without their hyper-parameters (torch then fails at the first step, or
    trains with the wrong ones). Refused before anything is read."""
    if t.groups is None or not isinstance(saved, list) or len(saved) == t.groups:
        return
    only = f"only=[{(t.owner or 'model') + '/*'!r}]"
    raise StateMismatchError(
        f"the optimizer at state key {key!r} in {where} was saved with {len(saved)} param group(s), the "
        f"target has {t.groups}; nothing was read. Build the optimizer with the param groups it was saved "
        f"with (the same split of parameters, e.g. with and without weight decay), or restore the model "
        f"without the optimizer: {only}"
    )


def _check_group_params(key: str, saved: Any, t: OptimizerTarget, where: str, stateful: Callable[[], set[str]]) -> None:
    """The saved param groups' parameters (FQNs) must fit the target's, group by group, as torch
    loads them by name: a target parameter that requires grad needs its place in the saved
    group, and a saved parameter that has state needs one in the target's (a model saved with
    other parameters, or untied where the target ties). Torch fails on either after the model
    was restored, so they are refused before anything is read. A frozen parameter on one side
    only passes (it has no state), and the order within a group does not matter."""
    if t.params is None or not isinstance(saved, list):
        return
    trainable = t.trainable or t.params
    with_state: set[str] | None = None
    for i, (g, every, needs) in enumerate(zip(saved, t.params, trainable)):
        got = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(got, list) or not all(isinstance(p, str) for p in got) or set(got) == every:
            continue
        lacks = sorted(needs - set(got))
        others = set(got) - every
        if others and with_state is None:
            with_state = stateful()
        extra = sorted(others & (with_state or set()))
        if not extra and not lacks:
            continue
        parts = [f"holds {_names(extra)}, which the target's lacks"] if extra else []
        parts += [f"lacks the target's {_names(lacks)}"] if lacks else []
        only = f"only=[{(t.owner or 'model') + '/*'!r}]"
        raise StateMismatchError(
            f"the optimizer at state key {key!r} in {where} was saved over other parameters than the "
            f"target's: its param group {i} {' and '.join(parts)}; nothing was read. Build the model "
            f"and optimizer as they were saved (the same trainable parameters and the same tied "
            f"weights), or restore the model without the optimizer: {only}"
        )


def _stateful(leaves: Mapping[str, Any], prefix: str) -> set[str]:
    """The parameter FQNs the checkpoint holds optimizer state for (``<prefix><fqn>/<name>``)."""
    return {k[len(prefix) :].partition("/")[0] for k in leaves if k.startswith(prefix)}


def _names(fqns: list[str], limit: int = 6) -> str:
    return ", ".join(fqns[:limit]) + (f" (+{len(fqns) - limit} more)" if len(fqns) > limit else "")


__all__ = ["METADATA_KEY", "OptimizerTarget", "check_optimizers", "optimizer_class", "optimizer_classes"]
