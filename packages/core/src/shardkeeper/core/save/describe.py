"""Which tensor leaves a save records by their rule (described layouts, format/grid.py), and
the digest by which the coordinator compares the ranks' choices. (A rank's index file is
written by save/index_write.py.)

A DTensor whose placements are plain Shard and Replicate has chunks that follow torch's
chunk rule, and so does an FSDP1 ShardedTensor (its sharded state dict splits dimension 0
over the ranks by ``torch.chunk``); a ZeRO ``Fragment`` that names its partition follows the
flat-partition rule. Its rank checks its own box against the rule (``describe_leaf``,
``describe_sharded``, ``describe_fragment``) and, when they agree, the manifest records the
mesh and placements once instead of a chunk per rank. Every rank decides from the same state alone; the coordinator compares the ranks' decisions
(``described_digest``) and refuses a save on which they differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import torch
import xxhash

from shardkeeper.core.format.columns import TABLE_MIN_CHUNKS
from shardkeeper.core.format.grid import (
    FLAT,
    REPLICATE,
    SHARD,
    Mesh,
    Rule,
    cell_box,
    flat_cell_boxes,
    flat_problem,
    replicas,
)
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import LocalLayout, replica_writer
from shardkeeper.core.state.fragment import Fragment


def describe_leaf(
    key: str, t: torch.Tensor, layout: LocalLayout, meshes: dict[Any, Any], world_size: int
) -> Rule | None:
    """The rule of DTensor ``t`` (``layout``: this rank's pieces of it), or None when it has
    none: a placement the rule has no word for, this rank's pieces are not the rule's box, or
    its mesh is not every rank of the saving world (mesh ranks are global ranks, so a
    subgroup's ranks are not theirs). A DTensor on a submesh of such a mesh (as FSDP2 over TP
    makes of the parameters it does not split along TP: each TP rank's copy lies on another
    submesh) is described on the whole mesh, replicated along the dimensions its submesh
    leaves out (``_on_root``). Every rank decides the same from its own DTensor.
    ``meshes`` caches each DeviceMesh's ranks and, for ``_StridedShard`` layouts, torch's
    verdict on every coordinate, by identity and signature."""
    dm = t.device_mesh  # type: ignore[attr-defined]
    root = tc.root_mesh(dm)
    if root is not dm and dm.ndim < root.ndim:  # (a slice of every dimension is the mesh itself)
        return _on_root(key, t, dm, root, layout, meshes, world_size)
    mesh = _mesh_of(dm, meshes)
    if (
        len(mesh.ranks) != world_size
        or not tc.is_whole_world(world_size)
        or sorted(mesh.ranks) != list(range(world_size))
    ):
        return None
    got = _placements(tuple(t.placements))  # type: ignore[attr-defined]
    if got is None:
        return None
    placements, order, strided = got
    shape = tuple(t.shape)
    coord = dm.get_coordinate()
    if coord is not None:
        offs, box = cell_box(shape, mesh, placements, coord, order)
        expect = [] if 0 in box else [(offs, box)]
        if [(p.offsets, p.shape) for p in layout.pieces] != expect:
            return None
    if strided:  # the reordering holds on this rank; torch decides it for every other one
        sig = ("strided", id(dm), shape, tuple(map(str, t.placements)))  # type: ignore[attr-defined]
        ok = meshes.get(sig)
        if ok is None:
            ok = meshes[sig] = _every_coordinate_agrees(shape, mesh, tuple(t.placements), placements, order)  # type: ignore[attr-defined]
        if not ok:
            return None
    return Rule(mesh, placements, replica_writer(key, replicas(mesh, placements)), order)


def _shared(mesh: Mesh, meshes: dict[Any, Any]) -> Mesh:
    """One ``Mesh`` object per content (described layouts are deduplicated by identity)."""
    return meshes.setdefault(("mesh", mesh.shape, mesh.ranks), mesh)  # type: ignore[no-any-return]


def _mesh_of(dm: Any, meshes: dict[Any, Any]) -> Mesh:
    """The ``Mesh`` of DeviceMesh ``dm``, cached by identity: DeviceMeshes of the same ranks share one."""
    mesh = meshes.get(id(dm))
    if mesh is None:
        mesh = meshes[id(dm)] = _shared(Mesh(*tc.mesh_ranks(dm)), meshes)
    return mesh


def _on_root(
    key: str, t: Any, dm: Any, root: Any, layout: LocalLayout, meshes: dict[Any, Any], world_size: int
) -> Rule | None:
    """The rule of DTensor ``t`` on submesh ``dm`` of mesh ``root``, recorded on ``root``:
    each submesh dimension's placement on the root dimension of its name, ``Replicate`` on
    the others (the copies the submesh does not name). None where a submesh dimension is no
    root dimension (a flattened one), a placement is ``_StridedShard`` or the rule has none,
    or this rank's pieces are not the rule's box."""
    dims = tc.submesh_dims(dm, root)
    if dims is None:
        return None
    mesh = _mesh_of(root, meshes)
    if not tc.is_whole_world(world_size) or sorted(mesh.ranks) != list(range(world_size)):
        return None
    rules = [tc.placement_rule(p) for p in t.placements]
    if any(r is None for r in rules):
        return None
    placements: list[tuple[Any, ...]] = [(REPLICATE,)] * len(mesh.shape)
    for m, r in zip(dims, rules):
        placements[m] = cast(tuple[Any, ...], r)
    pl = tuple(placements)
    coord = root.get_coordinate()
    if coord is None:
        return None
    offs, box = cell_box(tuple(t.shape), mesh, pl, coord)
    expect = [] if 0 in box else [(offs, box)]
    if [(p.offsets, p.shape) for p in layout.pieces] != expect:
        return None
    return Rule(mesh, pl, replica_writer(key, replicas(mesh, pl)))


def describe_sharded(
    key: str, st: torch.Tensor, layout: LocalLayout, meshes: dict[Any, Any], world_size: int
) -> Rule | None:
    """The rule of ShardedTensor ``st`` (FSDP1's sharded state dict: dimension 0 split over
    every rank of the world by torch's chunk rule), or None when this rank's shards are not
    that rule's box, or its process group is not the saving world (its placements name ranks
    of that group, which are then not the world's). The rank checks its own shard only, as a
    DTensor's does: the coordinator's comparison of the ranks' choices covers the others."""
    if world_size < 2 or tc.sharded_tensor_group_size(st) != world_size or not tc.is_whole_world(world_size):
        return None
    shape = tuple(st.shape)
    if not shape:
        return None
    mesh = _shared(Mesh((world_size,), tuple(range(world_size))), meshes)
    placements = ((SHARD, 0),)
    rank = tc.sharded_tensor_rank(st)
    offs, box = cell_box(shape, mesh, placements, (rank,))
    expect = [] if 0 in box else [(offs, box)]
    if [(p.offsets, p.shape) for p in layout.pieces] != expect:
        return None
    return Rule(mesh, placements, 0)


def describe_fragment(
    key: str, frag: Fragment, layout: LocalLayout, meshes: dict[Any, Any], world_size: int, rank: int
) -> Rule | None:
    """The flat-partition rule of a ZeRO ``Fragment`` that names its ``partition``, or None
    when it names none, the saving group is not the world, or this rank's boxes are not its
    part of that partition (each rank checks its own; the coordinator compares the ranks'
    choices, so a partition given otherwise on another rank refuses the save)."""
    if frag.partition is None or world_size < 2 or not tc.is_whole_world(world_size):
        return None
    mesh = _shared(Mesh((world_size,), tuple(range(world_size))), meshes)
    placements = ((FLAT, *frag.partition),)
    if flat_problem(frag.global_shape, mesh, placements) is not None:
        return None
    if [(p.offsets, p.shape) for p in layout.pieces] != flat_cell_boxes(frag.global_shape, placements, rank):
        return None
    return Rule(mesh, placements, 0)


def _placements(
    placements: tuple[Any, ...],
) -> tuple[tuple[tuple[Any, ...], ...], tuple[int, ...] | None, bool] | None:
    """DTensor placements in the rule's terms, the order the mesh dimensions apply in, and
    whether a ``_StridedShard`` was reordered; None where the rule has no word for them.

    ``_StridedShard(d, sf)`` on mesh dimension ``m`` (FSDP2 over TP on dimension ``d``) is a
    split of ``d`` that applies after the later mesh dimensions splitting ``d``, when their
    sizes multiply to ``sf``: it moves behind them in the order."""
    rules = [tc.placement_rule(p) for p in placements]
    order = list(range(len(placements)))
    strided = False
    for m, p in enumerate(placements):
        if rules[m] is not None:
            continue
        sf = tc.strided_split_factor(p)
        if sf is None:
            return None
        d = int(p.dim)
        rules[m] = ("S", d)
        if sf == 1:  # splits nothing before it: a plain Shard
            continue
        later = [k for k in range(m + 1, len(placements)) if tc.placement_rule(placements[k]) == ("S", d)]
        strided = True
        order.remove(m)
        order.insert(order.index(later[-1]) + 1 if later else len(order), m)
    return tuple(r for r in rules if r is not None), tuple(order) if strided else None, strided


def _every_coordinate_agrees(
    shape: tuple[int, ...], mesh: Mesh, torch_placements: tuple[Any, ...], placements: Any, order: Any
) -> bool:
    """Whether torch's own placement arithmetic gives every coordinate of the mesh exactly
    the rule's box (one contiguous box, or none): a layout described wrongly on any rank would
    make a checkpoint that restores wrong, so the rule is used only where torch agrees."""
    import itertools

    for coord in itertools.product(*map(range, mesh.shape)):
        local = list(shape)
        index: dict[int, torch.Tensor] = {}
        for m, p in enumerate(torch_placements):
            if tc.is_shard_placement(p):
                d = int(p.dim)
                local[d], index[d] = tc.shard_dim_indices(local[d], mesh.shape[m], coord[m], p, index.get(d))
        offs, box = cell_box(shape, mesh, placements, coord, order)
        if tuple(local) != box:
            return False
        if 0 in box:
            continue
        for d, idx in index.items():
            if int(idx[0]) != offs[d] or int(idx[-1]) != offs[d] + box[d] - 1:
                return False  # (a run of box[d] indices from its first to its last: contiguous)
    return True


def choose(candidates: dict[str, Rule], world_size: int, describe: bool | None) -> dict[str, Rule]:
    """The leaves a save describes: all candidates (``describe`` True), none (False), or,
    by default, all once they would make at least ``TABLE_MIN_CHUNKS`` chunks."""
    if describe is False or not candidates:
        return {}
    if describe is None and len(candidates) * world_size < TABLE_MIN_CHUNKS:
        return {}
    return candidates


def described_digest(described: Mapping[str, Rule]) -> str:
    """A digest of which leaves a rank describes and how: equal on every rank of a save."""
    mesh_ids: dict[int, str] = {}
    rows = []
    for key in sorted(described):
        rule = described[key]
        mid = mesh_ids.get(id(rule.mesh))
        if mid is None:
            mid = mesh_ids[id(rule.mesh)] = xxhash.xxh3_64_hexdigest(json.dumps(rule.mesh.to_json()).encode())
        rows.append([key, mid, rule.spec(0)[1:], rule.replica])
    return str(xxhash.xxh3_128_hexdigest(json.dumps(rows, separators=(",", ":")).encode()))


__all__ = ["Rule", "choose", "describe_fragment", "describe_leaf", "describe_sharded", "described_digest"]
