"""The canonical state: what the user passes, flattened into ``/``-separated keys and leaves.

- dicts recurse (``{"w": t, "meta": {"step": 3}}`` -> ``w``, ``meta/step``);
- ``nn.Module`` -> ``<key>/<fqn>`` through torch's ``get_model_state_dict`` (FQNs normalized);
- ``Optimizer`` -> ``<key>/state/<fqn>/<name>`` and ``<key>/param_groups``, keyed by parameter
  FQN through ``get_optimizer_state_dict`` (the owning module must be in the same state);
- objects with ``state_dict()``/``load_state_dict()`` recurse into their state dict;
- ``PerRank(x)`` (and ``RNGState``) put ``x`` under ``<key>/<rank>/...``;
- tensors, DTensors, ShardedTensors, flat-range ``Fragment`` objects (ZeRO partitions) and
  numpy arrays are tensor leaves; ``bytes`` are bytes leaves; JSON values (and lists/tuples
  holding no tensor) are object leaves.

Restoring flattens the *target* the same way, with a setter per leaf, so values land in the
caller's own objects: tensors are filled in place, objects are replaced in their container,
and stateful objects get ``load_state_dict`` with their own filled state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from shardkeeper.core.errors import JsonValueError, StateMismatchError
from shardkeeper.core.format.columns import without_gc
from shardkeeper.core.format.jsonvalue import check_value, describe_problem
from shardkeeper.core.state.fragment import Fragment
from shardkeeper.core.state.optim_compat import OptimizerTarget, optimizer_class
from shardkeeper.core.state.per_rank import PerRank, RNGState
from shardkeeper.core.state.tied import merge_ties, object_ties

#: Wrapper path components stripped from FQNs so one model has one set of keys everywhere.
WRAPPER_PREFIXES = (
    "module",
    "_fsdp_wrapped_module",
    "_orig_mod",
    "_checkpoint_wrapped_module",
    "_forward_module",
    "_offload_wrapped_module",
)


def normalize_fqn(fqn: str) -> str:
    parts = [p for p in fqn.split(".") if p not in WRAPPER_PREFIXES]
    return ".".join(parts)


def module_ties(key: str, module: nn.Module) -> list[tuple[str, ...]]:
    """The groups of ``key/<fqn>`` names under which ``module`` holds one parameter or buffer
    (the same object under several names: tied weights), from the module itself, so every
    rank finds the same groups."""
    by_object: dict[int, list[str]] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        by_object.setdefault(id(t), []).append(f"{key}/{normalize_fqn(name)}")
    return [tuple(dict.fromkeys(names)) for names in by_object.values() if len(set(names)) > 1]


#: The types of plain tensor leaves (flattened inline; their save plans are cached as they are).
PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def is_tensor_like(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, Fragment))


@dataclass(slots=True)
class Leaf:
    """One leaf of a flattened state. ``set`` replaces it in its container (restore only)."""

    key: str
    value: Any
    kind: str  # "tensor" | "bytes" | "object"
    per_rank: str | None = None  # the per-rank prefix this leaf lives under, if any
    set: Callable[[Any], None] | None = None


@dataclass
class FlatState:
    leaves: dict[str, Leaf] = field(default_factory=dict)
    per_rank_prefixes: list[str] = field(default_factory=list)
    #: ``(key prefix, fn)``, run in order after a restore filled the leaves: each pushes state
    #: into a stateful object, and runs only when some leaf under its prefix was restored.
    finalizers: list[tuple[str, Callable[[], object]]] = field(default_factory=list)
    #: The optimizers of a restore target, by state key: what restore checks the saved
    #: optimizer state against before it reads anything (``state/optim_compat.py``).
    optimizers: dict[str, OptimizerTarget] = field(default_factory=dict)
    #: Keys that name one tensor of a module (tied weights: GPT-2's ``lm_head.weight`` is
    #: ``transformer.wte.weight``), each group in the module's order (``state/tied.py``).
    ties: list[tuple[str, ...]] = field(default_factory=list)
    #: Keys of modules' buffers (BatchNorm's running statistics: under DDP each rank updates
    #: its own in its forward, so their copies may differ; save/replicas.py compares none).
    buffers: set[str] = field(default_factory=set)


def _contains_tensor(x: Any) -> bool:
    if is_tensor_like(x):
        return True
    if isinstance(x, Mapping):
        return any(_contains_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_contains_tensor(v) for v in x)
    return hasattr(x, "state_dict")


def _check_json(key: str, value: Any) -> None:
    """A JSON leaf must come back exactly (format/jsonvalue.py: valid Unicode, string keys; NaN,
    infinities and integers of any size are kept)."""
    try:
        check_value(value)
    except JsonValueError as e:
        if "is not a JSON value" not in e.why:
            raise StateMismatchError(f"state key {describe_problem(key, e)}") from None
        raise StateMismatchError(
            f"state key {key!r} holds a {type(value).__name__} that is not a tensor, bytes or "
            f"JSON value ({e}); nothing is pickled: convert it, or give its owner "
            f"state_dict()/load_state_dict() methods that return tensors and JSON values"
        ) from None


def _find_owner(opt: torch.optim.Optimizer, modules: dict[str, nn.Module], key: str) -> tuple[str, nn.Module]:
    """The state key and module that own ``opt``'s parameters."""
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for k, m in modules.items():
        if ids <= {id(p) for p in m.parameters()}:
            return k, m
    raise StateMismatchError(
        f"optimizer at state key {key!r} has parameters that no nn.Module in the same state "
        f"owns; optimizer state is keyed by parameter name, so put the model in the same "
        f"state, e.g. {{'model': model, {key!r}: optimizer}}"
    )


class _ItemSetter:
    """``container[key] = value``: a leaf's setter (restore makes one per leaf, so it is a
    slotted object, a fifth of a closure's memory with its cells)."""

    __slots__ = ("container", "key")

    def __init__(self, container: Any, key: Any) -> None:
        self.container = container
        self.key = key

    def __call__(self, value: Any) -> None:
        self.container[self.key] = value


class Flattener:
    """Flattens one state for one rank. ``restore=True`` records setters and finalizers."""

    def __init__(self, rank: int, *, restore: bool, strict: bool = True) -> None:
        self.rank = rank
        self.restore = restore
        self.strict = strict
        self.out = FlatState()

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        if not isinstance(state, Mapping):
            raise StateMismatchError(
                f"state must be a mapping of names to values, got {type(state).__name__}; "
                f"e.g. mgr.save(step, {{'model': model, 'optim': optimizer}})"
            )
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        for k, v in state.items():
            self._visit(str(k), v, modules, None, self._dict_setter(state, k))
        if self.restore:
            self.out.ties = merge_ties([*self.out.ties, *object_ties(self.out.leaves)])
        return self.out

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _dict_setter(container: Any, k: Any) -> Callable[[Any], None]:
        return _ItemSetter(container, k)

    @staticmethod
    def _frozen(key: str, i: int) -> Callable[[Any], None]:
        """Tensors inside a tuple are filled in place; anything else there cannot be replaced."""

        def set_(v: Any) -> None:
            raise StateMismatchError(
                f"state key {key}/{i} is a non-tensor value inside a tuple, which cannot be "
                f"replaced in place; use a list or a dict for that part of the state"
            )

        return set_

    def _add(self, key: str, value: Any, kind: str, per_rank: str | None, set_: Any) -> None:
        if key in self.out.leaves:
            raise StateMismatchError(f"state key {key!r} appears twice after flattening")
        self.out.leaves[key] = Leaf(key, value, kind, per_rank, set_ if self.restore else None)

    def _visit(self, key: str, v: Any, modules: dict[str, nn.Module], per_rank: str | None, set_: Any) -> None:
        if isinstance(v, PerRank) or getattr(v, "__shardkeeper_per_rank__", False):
            if per_rank is not None:
                raise StateMismatchError(f"state key {key!r}: PerRank inside PerRank")
            self.out.per_rank_prefixes.append(key)
            if isinstance(v, PerRank):
                inner_set = lambda x, w=v: setattr(w, "value", x)  # noqa: E731
                self._visit(f"{key}/{self.rank}", v.value, modules, key, inner_set)
            else:
                self._stateful(f"{key}/{self.rank}", v, key)
            return
        if isinstance(v, nn.Module):
            self._module(key, v, per_rank)
        elif isinstance(v, torch.optim.Optimizer):
            owner_key, owner = _find_owner(v, modules, key)
            self._optimizer(key, v, owner, per_rank, owner_key)
        elif is_tensor_like(v):
            self._add(key, v, "tensor", per_rank, set_)
        elif isinstance(v, (bytes, bytearray)):
            self._add(key, v, "bytes", per_rank, set_)
        elif isinstance(v, Mapping):
            if not v and not self.restore:
                self._add(key, {}, "object", per_rank, set_)
            # Plain tensors (the bulk of a large state) are added inline, without a setter: a
            # save needs none, and a restore fills tensors in place. With 10,000 small tensors
            # the per-leaf Python cost is most of the stall, and setters most of the leaves'
            # memory on restore.
            leaves = self.out.leaves
            restore = self.restore
            for k2, v2 in v.items():
                k = f"{key}/{k2}"
                if type(v2) in PLAIN_TENSORS and k not in leaves:
                    leaves[k] = Leaf(k, v2, "tensor", per_rank)
                else:
                    self._visit(k, v2, modules, per_rank, self._dict_setter(v, k2) if restore else None)
        elif isinstance(v, (list, tuple)) and _contains_tensor(v):
            for i, v2 in enumerate(v):
                setter = self._dict_setter(v, i) if isinstance(v, list) else self._frozen(key, i)
                self._visit(f"{key}/{i}", v2, modules, per_rank, setter)
        elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
            self._stateful(key, v, per_rank)
        else:
            if not self.restore:
                _check_json(key, v)
            self._add(key, v, "object", per_rank, set_)

    def _stateful(self, key: str, obj: Any, per_rank: str | None) -> None:
        sd = obj.state_dict()
        if not isinstance(sd, dict):
            raise StateMismatchError(
                f"{type(obj).__name__}.state_dict() at state key {key!r} returned {type(sd).__name__}, not a dict"
            )
        holder = {"sd": sd}
        self._visit(key, sd, {}, per_rank, self._dict_setter(holder, "sd"))
        if self.restore:
            self.out.finalizers.append((key, lambda: obj.load_state_dict(holder["sd"])))

    def _module(self, key: str, module: nn.Module, per_rank: str | None) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        sd = get_model_state_dict(module, options=StateDictOptions())
        buffers = {b.data_ptr() for b in module.buffers() if type(b) in PLAIN_TENSORS and b.numel()}
        for fqn, t in sd.items():
            self._visit(f"{key}/{normalize_fqn(fqn)}", t, {}, per_rank, self._dict_setter(sd, fqn))
            if isinstance(t, torch.Tensor) and type(t) in PLAIN_TENSORS and t.numel() and t.data_ptr() in buffers:
                self.out.buffers.add(f"{key}/{normalize_fqn(fqn)}")
        if self.restore:
            self.out.ties.extend(module_ties(key, module))
            strict = self.strict
            self.out.finalizers.append(
                (key, lambda: set_model_state_dict(module, sd, options=StateDictOptions(strict=strict)))
            )

    def _optimizer(
        self, key: str, opt: torch.optim.Optimizer, owner: nn.Module, per_rank: str | None, owner_key: str
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        osd = get_optimizer_state_dict(owner, opt, options=StateDictOptions())
        # torch types every value of an optimizer state dict alike; "state" maps parameter
        # FQNs to per-parameter dicts and "param_groups" is a list of dicts.
        state = cast("dict[str, dict[str, Any]]", osd.get("state", {}))
        for fqn, per_param in state.items():
            nfqn = normalize_fqn(str(fqn))
            for name, val in per_param.items():
                self._visit(f"{key}/state/{nfqn}/{name}", val, {}, per_rank, self._dict_setter(per_param, name))
        groups = cast("list[dict[str, Any]]", osd.get("param_groups", []))
        norm_groups = [{**g, "params": [normalize_fqn(str(p)) for p in g.get("params", [])]} for g in groups]
        if not self.restore:
            _check_json(f"{key}/param_groups", norm_groups)

        def set_groups(saved: Any) -> None:
            # Map saved FQNs back onto the target's own FQN spelling; keep the target's order.
            by_norm = {normalize_fqn(str(p)): p for g in groups for p in g.get("params", [])}
            fixed = []
            for g, tg in zip(saved, groups):
                g = conform(g, tg)
                g["params"] = [by_norm.get(p, p) for p in g.get("params", [])]
                fixed.append(g)
            osd["param_groups"] = fixed if len(saved) == len(groups) else saved

        self._add(f"{key}/param_groups", norm_groups, "object", per_rank, set_groups)
        if self.restore:
            # parameters that need no saved state: frozen ones (by FQN; one the names miss counts as trainable)
            frozen = {normalize_fqn(n): not p.requires_grad for n, p in owner.named_parameters(remove_duplicate=False)}
            self.out.optimizers[key] = OptimizerTarget(
                optimizer_class(opt),
                frozenset(k for g in groups for k in g if k != "params"),
                {normalize_fqn(str(f)): frozenset(per) for f, per in state.items() if per},
                owner_key,
                len(groups),
                tuple(frozenset(g["params"]) for g in norm_groups),
                tuple(frozenset(p for p in g["params"] if frozen.get(p) is not True) for g in norm_groups),
            )
            self.out.finalizers.append(
                (key, lambda: set_optimizer_state_dict(owner, opt, osd, options=StateDictOptions()))
            )


def conform(saved: Any, target: Any) -> Any:
    """Give a JSON-restored value the container types of the target (tuples stay tuples)."""
    if isinstance(target, tuple) and isinstance(saved, list):
        return tuple(conform(s, t) for s, t in zip(saved, target)) + tuple(saved[len(target) :])
    if isinstance(target, dict) and isinstance(saved, dict):
        return {k: conform(v, target[k]) if k in target else v for k, v in saved.items()}
    if isinstance(target, list) and isinstance(saved, list):
        return [conform(s, t) for s, t in zip(saved, target)] + saved[len(target) :]
    return saved


@without_gc  # one object per leaf: full collections over a large state would cost more
def flatten_for_save(state: Mapping[str, Any], rank: int) -> FlatState:
    return Flattener(rank, restore=False).flatten(state)


@without_gc  # a leaf, a setter and a key per tensor, alive until the restore ends
def flatten_for_restore(state: Mapping[str, Any], rank: int, *, strict: bool) -> FlatState:
    return Flattener(rank, restore=True, strict=strict).flatten(state)


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def as_torch(value: Any) -> torch.Tensor:
    """A tensor leaf as a torch tensor (numpy arrays are viewed, not copied)."""
    if isinstance(value, np.ndarray):
        if any(st < 0 for st in value.strides):
            raise StateMismatchError(
                "numpy arrays with negative strides cannot be saved or restored in place; "
                "pass a copy (np.ascontiguousarray) instead"
            )
        return torch.from_numpy(value)  # a view: restore fills the caller's array
    return cast("torch.Tensor", value)


__all__ = [
    "FlatState",
    "Flattener",
    "Leaf",
    "PLAIN_TENSORS",
    "PerRank",
    "RNGState",
    "WRAPPER_PREFIXES",
    "as_torch",
    "conform",
    "dtype_from_name",
    "flatten_for_restore",
    "flatten_for_save",
    "is_tensor_like",
    "normalize_fqn",
    "torch_dtype_name",
]
