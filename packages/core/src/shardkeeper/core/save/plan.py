"""Save planning, per rank: which chunks this rank writes, and in which shard file.

``plan_save`` decides from the flattened state alone (no communication: every rank computes
the same assignment); ``split_files`` groups the items into files; ``PlanCache`` reuses both
while the state's structure stays the same. Staging (``save/stage.py``) copies the items,
and ``save/write.py`` writes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shardkeeper.core.commit.merge import declared_digest
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.grid import replica_index
from shardkeeper.core.format.manifest import DTYPES
from shardkeeper.core.format.safetensors import PAD_PREFIX
from shardkeeper.core.format.table import without_gc
from shardkeeper.core.save.describe import (
    Rule,
    choose,
    describe_fragment,
    describe_leaf,
    describe_sharded,
    described_digest,
)
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import balance_plain, layout_of, plain_layout, replica_writer
from shardkeeper.core.state.copies import Copy, copy_of
from shardkeeper.core.state.flatten import PLAIN_TENSORS, FlatState, as_torch, torch_dtype_name
from shardkeeper.core.state.fragment import Fragment


@dataclass
class WriteItem:
    """One chunk this rank writes: a box of a leaf and the local view that holds it."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    src: torch.Tensor
    nbytes: int


@dataclass
class SavePlan:
    items: list[WriteItem] = field(default_factory=list)
    #: every tensor/bytes leaf this rank holds: key -> [kind, dtype, global shape]
    declared: dict[str, list[Any]] = field(default_factory=dict)
    #: object leaves this rank reports (replicated ones from the coordinator only)
    objects: dict[str, Any] = field(default_factory=dict)
    per_rank_prefixes: list[str] = field(default_factory=list)
    #: how this rank's tensors are distributed, for the manifest's metadata (not for restore)
    layouts: set[str] = field(default_factory=set)
    #: keys of per-rank leaves (declared by their rank alone)
    per_rank_keys: set[str] = field(default_factory=set)
    #: replicated leaves this rank holds and another copy writes (save/replicas.py compares them)
    replica_keys: list[str] = field(default_factory=list)
    #: leaves recorded by their rule (save/describe.py): key -> format.grid.Rule;
    #: their chunks go to this rank's index file, not its report
    described: dict[str, Rule] = field(default_factory=dict)
    #: What saves of this plan's structure compute once and reuse while the plan cache hits
    #: (the declarations' digest, each file's header): shared by every plan bound from one
    #: cached template, filled by the first save that needs an entry.
    memo: dict[Any, Any] = field(default_factory=dict)
    #: The cached template this plan was bound from (None: planned afresh, not cacheable);
    #: the stager reuses its buffer layout while the token stays the same.
    token: object | None = None
    #: A plan bound from the cache: its items are the template's (no tensor) and these are
    #: their sources, in file-group order (the groups flattened). None: each item's ``src``.
    sources: list[torch.Tensor] | None = None

    def report_declarations(self, coordinator: bool) -> dict[str, Any]:
        """What this rank tells the coordinator about its leaves: the coordinator keeps its
        whole table; other ranks send a digest of theirs plus their per-rank keys."""
        memo = self.memo.get("declarations")
        if memo is None:
            shared = {k: v for k, v in self.declared.items() if k not in self.per_rank_keys}
            own = {k: v for k, v in self.declared.items() if k in self.per_rank_keys}
            memo = self.memo["declarations"] = ({**shared, **own}, own, declared_digest(shared))
        whole, own, digest = memo
        return {"declared": whole if coordinator else own, "declared_digest": digest}

    def described_digest(self) -> str:
        """``describe.described_digest`` of this plan, computed once per cached plan."""
        got = self.memo.get("described")
        if got is None:
            got = self.memo["described"] = described_digest(self.described)
        return str(got)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def _dtype_name(key: str, dtype: torch.dtype) -> str:
    name = torch_dtype_name(dtype)
    if name not in DTYPES:
        raise StateMismatchError(
            f"state key {key!r} has dtype {name}, which the format does not store; supported: "
            f"{', '.join(DTYPES)}. Convert it (e.g. torch.view_as_real for complex) first"
        )
    return name


def describe_layout(t: torch.Tensor) -> str:
    """``DTensor(mesh=(2, 2), placements=(Shard(0), Shard(1)))``, ``ShardedTensor``, ``Tensor``."""
    if tc.is_dtensor(t):
        mesh = tuple(t.device_mesh.shape)
        names = t.device_mesh.mesh_dim_names
        placements = ", ".join(str(p) for p in t.placements)
        return f"DTensor(mesh={mesh}{', names=' + str(tuple(names)) if names else ''}, placements=({placements}))"
    if tc.is_sharded_tensor(t):
        return "ShardedTensor"
    if isinstance(t, Fragment):
        return "Fragment"
    return "Tensor"


@without_gc  # one object per leaf: full collections over a large state would cost more
def plan_save(flat: FlatState, rank: int, world_size: int, describe: bool | None = False) -> SavePlan:
    """Decide which chunks this rank writes, and (``describe``: the ``describe_layouts``
    option) which leaves are recorded by their rule. Deterministic: needs no communication."""
    plan = SavePlan(per_rank_prefixes=list(flat.per_rank_prefixes))
    layouts = {}
    copies: dict[str, Copy | None] = {}  # (the world's copies: a submesh's too, state/copies.py)
    candidates: dict[str, Rule] = {}
    meshes: dict[Any, Any] = {}
    plain_sizes: dict[str, int] = {}
    for key, leaf in flat.leaves.items():
        _check_key(key)  # (only when planning afresh: a cached plan has the same keys)
        if leaf.kind == "object":
            if leaf.per_rank is not None or rank == 0:
                plan.objects[key] = leaf.value
            continue
        if leaf.kind == "bytes":
            t = (
                torch.frombuffer(bytearray(leaf.value), dtype=torch.uint8)
                if leaf.value
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            t = as_torch(leaf.value)
            if tc.is_dtensor(t) and any(tc.is_partial(p) for p in t.placements):
                raise StateMismatchError(
                    f"state key {key!r} is a DTensor with a Partial placement (a pending "
                    f"reduction); call .redistribute() to Replicate/Shard before saving"
                )
        layout = plain_layout(t, 1, 0) if leaf.per_rank is not None else layout_of(t, world_size, rank)
        dtype = _dtype_name(key, layout.dtype)
        plan.declared[key] = [leaf.kind, dtype, list(layout.global_shape)]
        if leaf.per_rank is not None:
            plan.per_rank_keys.add(key)
        plan.layouts.add(describe_layout(t))
        layouts[key] = layout
        copies[key] = copy_of(t, layout, world_size) if leaf.per_rank is None else None
        if layout.plain and leaf.per_rank is None:
            plain_sizes[key] = math.prod(layout.global_shape) * DTYPES[dtype][1]
        elif describe is not False and leaf.per_rank is None and leaf.kind == "tensor":
            rule = None
            if tc.is_dtensor(t):
                rule = describe_leaf(key, t, layout, meshes, world_size)
            elif tc.is_sharded_tensor(t):
                rule = describe_sharded(key, t, layout, meshes, world_size)
            elif isinstance(t, Fragment):
                rule = describe_fragment(key, t, layout, meshes, world_size, rank)
            if rule is not None:
                candidates[key] = rule
    plan.described = choose(candidates, world_size, describe)
    writers = balance_plain(plain_sizes, world_size)
    for key, layout in layouts.items():
        rule = plan.described.get(key)
        if key in writers:
            if writers[key] != rank:
                plan.replica_keys.append(key)
                continue
        elif rule is not None:  # the rule's replica writes (on a submesh: copies the DTensor does not name)
            coord = rule.mesh.coordinate(rank)
            if coord is None or replica_index(rule.mesh, rule.placements, coord) != rule.replica:
                plan.replica_keys += [key] if coord is not None else []
                continue
        else:  # one copy writes; the others are compared with it (save/replicas.py)
            c = copies[key] or Copy(layout.replicas, layout.replica_index)
            if c.copies > 1 and replica_writer(key, c.copies) != c.index:
                plan.replica_keys.append(key)
                continue
        dtype = plan.declared[key][1]
        size = DTYPES[dtype][1]
        for p in layout.pieces:
            n = p.numel
            if n == 0:
                continue
            plan.items.append(WriteItem(key, dtype, layout.global_shape, p.offsets, p.shape, p.local, n * size))
    return plan


def _check_key(key: str) -> None:
    """Refuse a state key the format cannot store: one without a UTF-8 form, an empty one, or
    one in the prefix shard files reserve for padding."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StateMismatchError(
            f"state key {key!r} holds a lone surrogate ({key[e.start]!r} at position {e.start}, e.g. "
            f"from os.fsdecode of a non-UTF-8 name), which has no UTF-8 form: the key could not "
            f"be stored; rename it"
        ) from None
    if not key or key.startswith(PAD_PREFIX):
        raise StateMismatchError(
            f"state key {key!r} is empty or starts with {PAD_PREFIX!r}, which shard files reserve "
            f"for alignment padding (docs/format.md 4); rename it"
            if key
            else "a state key is empty (a dict with the key ''); give it a name"
        )


def _signature(flat: FlatState) -> tuple[Any, ...] | None:
    """What a save plan depends on, or None when the state holds a leaf whose plan cannot be
    rebound to new tensor objects (ShardedTensors, fragments, bytes: planned afresh).

    A plain tensor's plan is its shape, dtype and device. A DTensor's is also its mesh (held
    by the signature, so compared by identity first), its placements and its local shape.
    """
    sig: list[tuple[Any, ...]] = []
    for key, leaf in flat.leaves.items():
        if leaf.kind == "object":
            sig.append((key, leaf.per_rank is not None))
            continue
        t = leaf.value
        if leaf.kind != "tensor":
            return None
        if type(t) in PLAIN_TENSORS:
            sig.append((key, leaf.per_rank is not None, t.shape, t.dtype, t.device))
        elif tc.is_dtensor(t):
            sig.append(
                (
                    key,
                    leaf.per_rank is not None,
                    t.shape,
                    t.dtype,
                    t.device,
                    t.device_mesh,
                    tuple(t.placements),
                    tc.local_shape(t),
                )
            )
        else:
            return None
    return (tuple(flat.per_rank_prefixes), *sig)


_NO_TENSOR = torch.empty(0)


def _box_in(local: torch.Tensor, view: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """``view`` as ``local`` narrowed along each dimension, ``((start, length), ...)``, or
    None when it is not such a box of it (checked by rebuilding it)."""
    if view.dim() != local.dim() or view.dtype != local.dtype or not view.numel() or not local.is_contiguous():
        return None  # (a non-contiguous local may overlap itself: a box would not be unique)
    delta, rem = divmod(view.data_ptr() - local.data_ptr(), local.element_size())
    if rem or delta < 0:
        return None
    box = []
    strides = local.stride()
    for d in sorted(range(local.dim()), key=lambda d: -strides[d]):
        st = strides[d]
        start = delta // st if st else 0
        delta -= start * st
        box.append((d, start))
    starts = dict(box)
    out = tuple((starts[d], view.shape[d]) for d in range(local.dim()))
    if delta:
        return None
    try:
        again = _narrowed(local, out)
    except (RuntimeError, IndexError):  # a start or length out of range: not a box of it
        return None
    same = again.shape == view.shape and again.stride() == view.stride() and again.data_ptr() == view.data_ptr()
    return out if same else None


def _narrowed(local: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        if start or length != local.shape[d]:
            local = local.narrow(d, start, length)
    return local


def _rebinder(items: Sequence[WriteItem], flat: FlatState) -> list[Any] | None:
    """How each item's source is found in a later state of the same structure: ``None`` for
    a leaf's whole value (a plain tensor), else the box of the DTensor's ``to_local()`` that
    holds it (``_box_in``). None (do not cache) when a source is no such box."""
    out: list[Any] = []
    for it in items:
        v = flat.leaves[it.key].value
        if not tc.is_dtensor(v):
            out.append(None)
            continue
        if tc.is_dtensor(it.src):  # a per-rank DTensor leaf is its own source: not rebound
            return None
        box = _box_in(v.to_local(), it.src)
        if box is None:
            return None
        out.append(box)
    return out


class PlanCache:
    """The last save plan and file grouping of a manager, reused while the state's structure
    (every leaf's key, kind, shape, dtype and device; for DTensors also the mesh, placements
    and local shape) is unchanged: a state of 10,000 small tensors then skips planning, which
    costs more than copying it. New tensor objects (a fresh ``state_dict()`` each save) are
    bound into the cached plan: a plain tensor as its item's source, a DTensor through the
    same box of its ``to_local()`` (uneven shards are narrowed). ShardedTensors and fragments
    are planned afresh every save."""

    def __init__(self) -> None:
        self._sig: tuple[Any, ...] | None = None
        self._plan: SavePlan | None = None
        self._groups: list[list[WriteItem]] = []  # each file's template items
        self._order: list[tuple[str, Any]] = []  # per item in group order: its key and _rebinder's way
        self.hits = 0

    @without_gc
    def plan(
        self,
        flat: FlatState,
        rank: int,
        world_size: int,
        max_files: int,
        min_file_bytes: int,
        describe: bool | None = False,
    ) -> tuple[SavePlan, list[list[WriteItem]]]:
        sig = _signature(flat)
        if sig is not None:
            sig = (describe, *sig)
        cached = self._plan
        if sig is not None and cached is not None and sig == self._sig:
            self.hits += 1
            leaves = flat.leaves
            # No new WriteItem per leaf: the template's items are reused and only the sources
            # are looked up (with 10,000 tensors, building items cost as much as the copy).
            sources = [
                leaves[k].value if b is None else _narrowed(leaves[k].value.to_local(), b) for k, b in self._order
            ]
            objects = {k: leaves[k].value for k in cached.objects}
            return replace(cached, objects=objects, sources=sources), self._groups
        plan = plan_save(flat, rank, world_size, describe)
        groups = split_files(plan.items, max_files, min_file_bytes)
        self._sig, self._plan = None, None
        bind = _rebinder(plan.items, flat) if sig is not None else None
        if sig is not None and bind is not None:
            plan.token = object()
            # The template holds no tensor or value of this save: nothing stays alive through it.
            template = {id(it): replace(it, src=_NO_TENSOR) for it in plan.items}
            how = {id(it): b for it, b in zip(plan.items, bind)}
            self._groups = [[template[id(it)] for it in g] for g in groups]
            self._order = [(it.key, how[id(it)]) for g in groups for it in g]
            self._sig, self._plan = (
                sig,
                replace(plan, items=[template[id(it)] for it in plan.items], objects=dict.fromkeys(plan.objects)),
            )
        return plan, groups


def split_files(items: Sequence[WriteItem], max_files: int, min_file_bytes: int) -> list[list[WriteItem]]:
    """Group items into up to ``max_files`` files of at least ``min_file_bytes`` (balanced by
    size), each in file order. Files are written in parallel."""
    if not items:
        return []
    total = sum(i.nbytes for i in items)
    n = max(1, min(max_files, total // max(min_file_bytes, 1)))
    if n == 1:
        return [sorted(items, key=_file_order)]
    bins: list[list[WriteItem]] = [[] for _ in range(n)]
    loads = [0] * n
    for it in sorted(items, key=lambda i: -i.nbytes):
        j = min(range(n), key=lambda k: loads[k])
        bins[j].append(it)
        loads[j] += it.nbytes
    return [sorted(b, key=_file_order) for b in bins if b]


def _file_order(it: WriteItem) -> tuple[int, str, tuple[int, ...]]:
    """Widest dtypes first: with the header padded to 8 bytes, every chunk then starts at a
    multiple of its item size, so readers can view the bytes as the dtype without a copy."""
    return (-DTYPES[it.dtype][1], it.key, it.offsets)


__all__ = ["PlanCache", "SavePlan", "WriteItem", "describe_layout", "plan_save", "split_files"]
