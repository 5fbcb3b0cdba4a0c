"""Tied weights on restore: a target key the checkpoint lacks is no missing key when its
tensor is the very tensor of another target key the checkpoint holds.

A module's ``state_dict()`` lists a tied weight under every name it has (GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``), while a save that walks
``named_parameters()`` (DeepSpeed's engine state, for one) holds it under one name. Restoring
the twin fills the alias too, since they share their memory; so a strict restore of such a
checkpoint into the module must not fail on the alias.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.tensor.state import Leaf, as_torch


def _memory(leaf: Leaf) -> tuple[Any, ...] | None:
    """Where a plain tensor leaf's elements live (None: not a plain tensor with memory)."""
    if leaf.kind != "tensor" or leaf.per_rank is not None:
        return None
    try:
        t = as_torch(leaf.value)
    except StateMismatchError:  # a numpy array it cannot view
        return None
    if (
        not isinstance(t, torch.Tensor)
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.is_meta
        or t.numel() == 0
    ):
        return None
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def tied_aliases(leaves: Mapping[str, Leaf], missing: Iterable[str], restored: Iterable[str]) -> dict[str, str]:
    """Each of ``missing`` whose tensor is a restored key's tensor, mapped to that key."""
    by_memory: dict[tuple[Any, ...], str] = {}
    for key in restored:
        leaf = leaves.get(key)
        where = _memory(leaf) if leaf is not None else None
        if where is not None:
            by_memory.setdefault(where, key)
    out: dict[str, str] = {}
    for key in missing:
        leaf = leaves.get(key)
        where = _memory(leaf) if leaf is not None else None
        if where is not None and where in by_memory:
            out[key] = by_memory[where]
    return out


__all__ = ["tied_aliases"]
