"""Restore planning, per rank: which bytes of which saved chunks fill which target pieces.

``plan_restore`` matches the target's leaves with the manifest's and refuses, before any
read, what the target cannot take (shapes, dtypes, kinds, meta tensors, missing keys under
``strict``). Each overlap of a target piece and a saved chunk becomes an ``Op``: the minimal
contiguous byte range of the chunk that holds it, split along dimension 0 so that no read
exceeds ``max_read_bytes``. ``restore/reads.py`` then sorts the ops by how they are read.
"""

from __future__ import annotations

import fnmatch
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.manifest import ChunkRecord, LeafRecord, Manifest, itemsize
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.restore.per_rank import PER_RANK_POLICIES, PLAIN_CALL, source_key
from shardkeeper.core.state.chunks import Piece, contiguous_strides, layout_of
from shardkeeper.core.state.flatten import (
    FlatState,
    Leaf,
    as_torch,
    conform,
    dtype_from_name,
    torch_dtype_name,
)
from shardkeeper.core.state.optim_compat import check_optimizers
from shardkeeper.core.state.tied import check_ties, tied_aliases
from shardkeeper.core.storage.base import Storage

#: Tests only: called with each plan before it is read, to misplace pieces on purpose (the
#: restore's logical check must catch what a wrong plan assembles). None in use.
FAULT: Callable[[RestorePlan], None] | None = None


@dataclass
class RestoreStats:
    """What a restore read: for tests and benchmarks (bytes read vs bytes needed)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_direct: int = 0  # read straight into the target's memory, no scratch buffer
    bytes_received: int = 0  # from the rank that read them (``restore/share.py``), not in bytes_read
    reads: int = 0
    #: index files of described leaves (format.md 3.8) read to plan: the ranks that wrote what
    #: this rank restores, never every rank's
    index_files: int = 0
    #: pages (format.md 3.9) read to find those index files: the pages of those ranks alone
    pages: int = 0
    files: set[str] = field(default_factory=set)
    keys: int = 0
    #: this rank's part of the check of what it assembled (``restore/logical_check.py``):
    #: None when not checked (no digests recorded, ``logical_check="off"``)
    logical: Any = None
    #: the restored step's ``replicas_disagree`` mark (docs/format.md 6.1: copies of these
    #: replicated tensors disagreed at its save; each written copy was restored), else None
    replicas_disagree: str | None = None
    #: with a local tier under ``erasure=``: the files (root-relative) this restore rebuilt
    #: from parity before reading, a lost node's or one no node held a good copy of, every
    #: rank alike (docs/tiers.md); else []
    rebuilt: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_read(self, file: str, n: int, *, direct: bool = False) -> None:
        with self._lock:
            self.bytes_read += n
            self.bytes_direct += n if direct else 0
            self.reads += 1
            self.files.add(file)


@dataclass(slots=True)
class Op:
    """Copy one box (the overlap of a target piece and a saved chunk) into the target."""

    key: str
    chunk: ChunkRecord
    dtype: torch.dtype
    dest: torch.Tensor
    rel_lo: tuple[int, ...]  # overlap box relative to the chunk
    rel_shape: tuple[int, ...]
    start: int  # minimal contiguous byte range within the chunk
    end: int
    #: the overlap is ``dest``'s whole memory, byte for byte, and under ``_DIRECT_MIN_BYTES``
    #: (``restore/reads.py``): a buffered read copies it with one memmove instead of building a
    #: source view and calling ``copy_`` (about 10 us per tensor, in threads sharing the GIL)
    as_bytes: bool = False


def overlap_ops(key: str, piece: Piece, chunk: ChunkRecord, dtype: torch.dtype, isz: int, max_read: int) -> list[Op]:
    """The copies that move the overlap of ``piece`` and ``chunk`` (split along dimension 0
    so that no single read exceeds ``max_read`` bytes); none if they do not overlap."""
    poffs, pshape, coffs, cshape = piece.offsets, piece.shape, chunk.offsets, chunk.shape
    ndim = len(cshape)
    if ndim == 0:
        return [Op(key, chunk, dtype, piece.local, (), (), 0, isz)]
    if poffs == coffs and pshape == cshape:  # the common case: the piece is the chunk
        nbytes = math.prod(cshape) * isz
        if nbytes <= max_read:  # ... and one read: the whole chunk into the whole piece
            return [Op(key, chunk, dtype, piece.local, (0,) * ndim, tuple(cshape), 0, nbytes)]
        rel_lo, shape = [0] * ndim, list(cshape)
    else:
        rel_lo, shape = [], []
        for d in range(ndim):
            lo = max(poffs[d], coffs[d])
            hi = min(poffs[d] + pshape[d], coffs[d] + cshape[d])
            if lo >= hi:
                return []
            rel_lo.append(lo - coffs[d])
            shape.append(hi - lo)
    strides = contiguous_strides(cshape)
    row_bytes = strides[0] * isz
    step = max(1, max_read // max(row_bytes, 1))
    # Offsets of the overlap within the chunk beyond dimension 0 (the same for every slab).
    inner_first = sum(rel_lo[d] * strides[d] for d in range(1, ndim))
    inner_last = sum((rel_lo[d] + shape[d] - 1) * strides[d] for d in range(1, ndim))
    ops = []
    rows = shape[0]
    for r0 in range(0, rows, step):
        n = min(rows - r0, step)
        lo0 = rel_lo[0] + r0
        sub_lo = (lo0, *rel_lo[1:])
        sub_shape = (n, *shape[1:])
        first = lo0 * strides[0] + inner_first
        last = (lo0 + n - 1) * strides[0] + inner_last
        dest = piece.local
        for d in range(ndim):
            start_in_piece = coffs[d] + sub_lo[d] - poffs[d]
            if start_in_piece != 0 or sub_shape[d] != dest.shape[d]:
                dest = dest.narrow(d, start_in_piece, sub_shape[d])
        ops.append(Op(key, chunk, dtype, dest, sub_lo, sub_shape, first * isz, (last + 1) * isz))
    return ops


#: A target piece to fill: its key, the saved key it reads, the piece, the saved dtype and
#: its item size.
Wanted = tuple[str, str, Piece, torch.dtype, int]


def piece_ops(leaves: Mapping[str, Any], wanted: Sequence[Wanted], max_read: int) -> list[Op]:
    """The ops that fill each piece of ``wanted`` from the saved chunks it overlaps. A
    table-form manifest makes only those chunks' records, in one batch (``TableLeaves.
    overlapping_many``); the common op, a piece that is one whole chunk read at once, is made
    inline."""
    if isinstance(leaves, TableLeaves):
        found = leaves.overlapping_many([(w[1], w[2].offsets, w[2].shape) for w in wanted])
    else:
        found = [leaves[w[1]].chunks for w in wanted]
    ops: list[Op] = []
    append = ops.append
    for (key, _, piece, dtype, isz), chunks in zip(wanted, found):
        for chunk in chunks:
            shape = chunk.shape
            nbytes = math.prod(shape) * isz
            if shape and nbytes <= max_read and shape == piece.shape and chunk.offsets == piece.offsets:
                append(Op(key, chunk, dtype, piece.local, (0,) * len(shape), tuple(shape), 0, nbytes))
            else:
                ops.extend(overlap_ops(key, piece, chunk, dtype, isz, max_read))
    return ops


def matches(key: str, patterns: Sequence[str] | None) -> bool:
    """Does ``key`` match one of ``patterns`` (a glob, a ``/``-prefix, the key itself)?"""
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(key, p) or key.startswith(p.rstrip("/") + "/") or key == p for p in patterns)


def listing(items: Sequence[str], limit: int = 20) -> str:
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


@dataclass
class RestorePlan:
    """What one attempt reads and sets (``plan_restore``)."""

    stats: RestoreStats
    ops: list[Op] = field(default_factory=list)  # the tensors' copies
    restored: list[str] = field(default_factory=list)  # target keys the step holds
    deferred: list[tuple[str, Callable[[], None]]] = field(default_factory=list)  # objects, set last
    bytes_leaves: list[tuple[str, Leaf, LeafRecord]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # saved keys absent (strict=False: warned)
    dropped: list[str] = field(default_factory=list)  # per-rank keys that keep their values (restore/per_rank.py)


def plan_restore(
    storage: Storage,
    manifest: Manifest,
    flat: FlatState,
    *,
    rank: int,
    world_size: int,
    only: Sequence[str] | None,
    strict: bool,
    optional: Sequence[str] | None,
    per_rank: str,
    cast: bool,
    max_read_bytes: int,
    where: str,
    per_rank_call: str = PLAIN_CALL,
) -> RestorePlan:
    """Match ``flat``'s leaves with ``manifest``'s; raise ``StateMismatchError`` for what the
    target cannot take, before anything is read. ``where`` names the step and rank;
    ``per_rank_call`` where the user sets ``per_rank`` (for the refusal's message)."""
    if flat.optimizers:
        check_optimizers(flat.optimizers, manifest, lambda k: matches(k, only), where)
    plan = RestorePlan(RestoreStats())
    refused = _Refused()
    table = manifest.leaves if isinstance(manifest.leaves, TableLeaves) else None
    wanted: list[Wanted] = []  # each target piece, its chunks found once every leaf is checked
    for key, leaf in flat.leaves.items():
        if not matches(key, only):
            continue
        src_key = source_key(leaf.per_rank, key, rank, manifest.world_size, world_size, per_rank, where, per_rank_call)
        if src_key is None:
            plan.dropped.append(key)
            continue
        rec = table.head(src_key) if table is not None else manifest.leaves.get(src_key)
        if rec is None and leaf.per_rank is not None and manifest.world_size != world_size:
            plan.dropped.append(key)  # per-rank state shaped by the world size (a loader's): kept
            continue
        if rec is None:
            if not (optional and matches(key, optional)):
                plan.missing.append(src_key)
            continue
        plan.stats.keys += 1
        plan.restored.append(key)
        if leaf.kind == "object" or rec.kind in ("object", "bytes"):
            _plan_value(plan, key, leaf, rec, manifest, src_key, where)
        else:
            _want_pieces(plan.stats, wanted, refused, key, src_key, leaf, rec, rank, world_size, cast)
    refused.raise_any(where)
    if only and not plan.stats.keys and not plan.missing and not plan.dropped:
        raise StateMismatchError(
            f"only={list(only)} matches no key of the target state in {where}; list the "
            f"checkpoint's keys with `shardkeeper inspect {storage.url} {manifest.step}`"
        )
    if flat.ties:  # two saved tensors for one tied tensor: refused unless they are the same bytes
        check_ties(flat.ties, plan.restored, lambda k: manifest.leaves[k].chunks, manifest.digest_algorithm, where)
    if plan.missing:  # a tied weight's alias is filled through its twin
        tied = tied_aliases(flat.ties, plan.missing, plan.restored)
        plan.missing = [k for k in plan.missing if k not in tied]
    if plan.missing and strict:
        raise StateMismatchError(
            f"{len(plan.missing)} key(s) of the target state are not in {where}: {missing_list(plan.missing)}; "
            f"restore a subset with only=[...] or pass strict=False to skip them{_imported(manifest)}"
        )
    plan.ops.extend(piece_ops(manifest.leaves, wanted, max_read_bytes))
    if FAULT is not None:
        FAULT(plan)
    return plan


def _imported(manifest: Manifest) -> str:
    """For a step an importer wrote (its ``imported_from`` metadata): what it holds, and how
    a training loop starts from it."""
    meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
    source = meta.get("imported_from")
    if not isinstance(source, str):
        return ""
    kind = meta.get("imported_format")
    return (
        f". Step {manifest.step} was imported from {source}{f' ({kind})' if isinstance(kind, str) else ''}: it "
        f"holds what that source held (Hugging Face weights: the model alone, no optimizer state); start "
        f"from it with only=['model/*'], then save the steps after it"
    )


def _plan_value(
    plan: RestorePlan, key: str, leaf: Leaf, rec: LeafRecord, manifest: Manifest, src_key: str, where: str
) -> None:
    """An object leaf, set after every tensor, or a bytes leaf, read after every check (from
    its record under ``src_key``)."""
    if leaf.kind == "object" or rec.kind == "object":
        if leaf.kind != rec.kind:
            raise StateMismatchError(
                f"key {key!r} in {where} is a {rec.kind} leaf in the checkpoint but a "
                f"{leaf.kind} in the target state; the state's structure changed"
            )
        assert leaf.set is not None
        setter, value, current = leaf.set, rec.value, leaf.value

        def fill(s: Callable[[Any], None] = setter, v: Any = value, c: Any = current) -> None:
            s(conform(v, c))

        plan.deferred.append((key, fill))
        return
    if leaf.kind != "bytes":
        raise StateMismatchError(
            f"key {key!r} in {where} is a bytes leaf in the checkpoint but a {leaf.kind} "
            f"in the target state; the state's structure changed"
        )
    plan.bytes_leaves.append((key, leaf, manifest.leaves[src_key]))


@dataclass
class _Refused:
    """Tensor leaves the target cannot take, gathered so that one error names them all."""

    on_meta: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)

    def raise_any(self, where: str) -> None:
        if self.on_meta:
            raise StateMismatchError(
                f"{len(self.on_meta)} tensor(s) of the target state are on the meta device (a shape without "
                f"memory: restoring into them would do nothing), so nothing of {where} was read: "
                f"{listing(self.on_meta, 8)}. Give the model memory first, model.to_empty(device=...) "
                f"(build the optimizer after that), or build it on a real device, then restore"
            )
        if self.mismatched:
            raise StateMismatchError(
                f"{len(self.mismatched)} key(s) in {where} have another shape than the target state: "
                f"{listing(self.mismatched)}; build the model with the saved configuration, or exclude "
                f"the keys with only=[...]"
            )
        if self.wrong_dtype:
            raise StateMismatchError(
                f"{len(self.wrong_dtype)} key(s) in {where} have another dtype than the target state: "
                f"{listing(self.wrong_dtype)}; pass cast_dtypes=True to cast on restore"
            )


def _want_pieces(
    stats: RestoreStats,
    wanted: list[Wanted],
    refused: _Refused,
    key: str,
    src_key: str,
    leaf: Leaf,
    rec: LeafRecord,
    rank: int,
    world_size: int,
    cast: bool,
) -> None:
    """Add a tensor leaf's pieces on this rank to ``wanted``, or the reason it cannot take the
    saved tensor to ``refused``."""
    target = as_torch(leaf.value)
    layout = layout_of(target, world_size, rank)
    if any(p.local.is_meta for p in layout.pieces):
        refused.on_meta.append(key)  # no memory: a copy into it does nothing
        return
    if tuple(layout.global_shape) != tuple(rec.shape):
        refused.mismatched.append(f"{key!r}: checkpoint shape {list(rec.shape)}, target {list(layout.global_shape)}")
        return
    saved_dtype = dtype_from_name(rec.dtype)
    if saved_dtype != layout.dtype and not cast:
        refused.wrong_dtype.append(f"{key!r}: checkpoint {rec.dtype}, target {torch_dtype_name(layout.dtype)}")
        return
    isz = itemsize(rec.dtype)
    for piece in layout.pieces:
        stats.bytes_needed += piece.numel * isz
        wanted.append((key, src_key, piece, saved_dtype, isz))


def missing_list(missing: Sequence[str]) -> str:
    """The first missing keys, as messages list them."""
    return f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"


__all__ = [
    "Op",
    "PER_RANK_POLICIES",
    "RestorePlan",
    "RestoreStats",
    "Wanted",
    "listing",
    "matches",
    "missing_list",
    "overlap_ops",
    "piece_ops",
    "plan_restore",
]
