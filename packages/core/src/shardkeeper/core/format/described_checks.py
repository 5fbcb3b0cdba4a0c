"""The checks of a manifest's described columns (format/described.py) before any is used:
types and lengths, the meshes, each layout's placements, and each leaf's layout and replica."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkeeper.core.format.columns import MAX_NDIM
from shardkeeper.core.format.grid import Mesh, flat_problem, is_flat, placements_problem, replicas
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.format.untrusted import strings_only

#: A layout as checked: its mesh, placements and (optional) order of the sharding mesh dims.
Spec = tuple[Mesh, tuple[tuple[Any, ...], ...], Any]


def _layout_problem(specs: Sequence[tuple[Mesh, Any, Any]], li: int, rep: int, nd: int) -> str | None:
    """Why a leaf of ``nd`` dimensions cannot be replica ``rep`` of layout ``li``, or None."""
    if li >= len(specs):
        return f"layout {li} is not one of the {len(specs)} described layouts"
    mesh, pl, order = specs[li]
    why = placements_problem(pl, mesh, nd, order)
    if why is not None:
        return why
    got = replicas(mesh, pl)
    return f"replica {rep} of a layout with {got} replicas" if rep >= got else None


def columns_problem(d: Any, world_size: int) -> tuple[str | None, list[Spec]]:
    """Why the described columns of ``d`` (a ``DescribedLeaves``) cannot be trusted (types, lengths, the rule's fields,
    each leaf's layout), or None with the layouts as (mesh, placements, order)."""
    n = len(d.keys) if isinstance(d.keys, list) else -1
    cols = (d.kind, d.dtype, d.ndim, d.shape, d.layout, d.replica)
    if n < 0 or not all(isinstance(c, list) for c in cols):
        return "described columns are not arrays", []
    if not (len(d.kind) == len(d.dtype) == len(d.ndim) == len(d.layout) == len(d.replica) == n):
        return "described columns differ in length", []
    if not strings_only(d.keys) or len(d.pos) != n:
        return "described keys are not distinct strings", []
    for c in (d.ndim, d.shape, d.layout, d.replica):
        if c and (not set(map(type, c)) <= {int} or min(c) < 0):
            return "described columns hold something other than non-negative integers", []
    if (d.ndim and max(d.ndim) > MAX_NDIM) or len(d.shape) != sum(d.ndim):
        return "described shape does not match its ndim column", []
    if not set(d.kind) <= {"tensor"} or not all(t in DTYPES for t in set(d.dtype)):
        return "a described leaf is not a tensor of a known dtype", []
    for m in d.meshes:
        why = m.problem(world_size)
        if why is not None:
            return why, []
    specs = []
    for spec in d.layouts:
        if not (
            isinstance(spec, list)
            and len(spec) in (2, 3)
            and type(spec[0]) is int
            and 0 <= spec[0] < len(d.meshes)
            and isinstance(spec[1], list)
            and all(isinstance(p, list) for p in spec[1])
        ):
            return "a described layout is not [mesh index, placements] or [mesh index, placements, order]", []
        specs.append((d.meshes[spec[0]], tuple(tuple(p) for p in spec[1]), spec[2] if len(spec) == 3 else None))
    # Each leaf's (layout, replica, ndim) judged once per distinct value (100,000 leaves
    # have a few); the leaves are walked only for flat partitions (their shapes) or to
    # name the first leaf of a problem.
    kinds = {t: _layout_problem(specs, *t) for t in set(zip(d.layout, d.replica, d.ndim))}
    flat = {li for li, (_, pl, _) in enumerate(specs) if is_flat(pl)}
    if flat or any(why is not None for why in kinds.values()):
        for j, t in enumerate(zip(d.layout, d.replica, d.ndim)):
            why = kinds[t]
            if why is None and t[0] in flat:  # (its placements checked)
                why = flat_problem(d.shapes()[j], specs[t[0]][0], specs[t[0]][1])
            if why is not None:
                return f"{d.keys[j]}: {why}", []
    return None, specs


__all__ = ["Spec", "columns_problem"]
