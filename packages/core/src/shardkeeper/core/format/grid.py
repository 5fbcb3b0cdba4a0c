"""The closed-form rule of a described layout (docs/format.md 3.8): which
box of a tensor each rank of a device mesh holds, and which rank writes it.

A described leaf records a mesh (its shape and the rank at each coordinate, row-major), one
placement per mesh dimension (``["S", d]``: that mesh dimension splits tensor dimension
``d``; ``["R"]``: it replicates), optionally the order in which the mesh dimensions apply
(default: mesh-dimension order; FSDP2 over TP on one dimension, torch's ``_StridedShard``,
applies the TP split first), and a replica index. Mesh dimensions that split the same tensor
dimension apply in that order, each to the range the previous one left, by torch's chunk
rule: a range of ``n`` elements split ``k`` ways gives part ``c`` the
elements ``[c * f, min(n, (c + 1) * f))`` with ``f = ceil(n / k)`` (empty past the end).
Of the ranks that hold the same box (they differ only in replicating coordinates), the one
whose replicating coordinates, read as a row-major number in mesh-dimension order, equal
the replica index writes it.

A *flat partition* (ZeRO) is the sole placement of a 1-D mesh, ``["F", pos, part]``: the
tensor's row-major flattened elements lie at ``[pos, pos + numel)`` of a buffer whose
consecutive parts of ``part`` elements the mesh's coordinates hold in order; the range a
coordinate holds of the tensor is the union of a few boxes (``flat_range_boxes``), each a
chunk of its own.

Torch-free and storage-free: writers check their own boxes against it, readers derive the
chunks a restore needs from it (``overlapping_cells``), with work proportional to the cells
found, never to the mesh's size. The cells come one at a time, never as a list: a reader
reads each one's index file as it comes, so a forged rule that claims millions of cells
fails at the first one the step's files do not back, having derived only that one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.format.bounds import MAX_WORLD_SIZE

SHARD, REPLICATE, FLAT = "S", "R", "F"
#: Most ranks a mesh of a manifest may hold: its ranks are ranks of the world.
MAX_MESH_RANKS = MAX_WORLD_SIZE
#: Most dimensions a mesh may have (torch's meshes have a few).
MAX_MESH_DIMS = 16


def chunk_part(length: int, parts: int, c: int) -> tuple[int, int]:
    """Torch's chunk rule: part ``c`` of ``parts`` of a range of ``length`` elements, as
    (start, size); a part past the end is empty (start ``length``, size 0)."""
    full = -(-length // parts) if length else 0
    start = full * c
    if start >= length:
        return length, 0
    return start, min(length, start + full) - start


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape, and the rank at each coordinate (row-major)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    _where: dict[int, int] = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: the first rank of a mesh read in the compact form (its ranks consecutive), else None
    _first: int | None = field(default=None, compare=False, hash=False, repr=False)

    def to_json(self, *, compact: bool = False) -> dict[str, Any]:
        """``compact`` (the writer's form with pages): a mesh of consecutive ranks in order as
        its first rank, not a list of every rank (16,384 ranks are 100 KB of manifest otherwise)."""
        r0 = self.ranks[0] if self.ranks else 0
        if compact and (self._first is not None or tuple(self.ranks) == tuple(range(r0, r0 + len(self.ranks)))):
            return {"shape": list(self.shape), "first_rank": r0}
        return {"shape": list(self.shape), "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Mesh:
        if "first_rank" in d:
            first, n = d["first_rank"], math.prod(d["shape"])
            if n > MAX_MESH_RANKS:  # (a number: a few bytes of shape must not make millions of ranks)
                many = n if n < 1 << 64 else "over 2**64"
                raise ValueError(
                    f"a mesh of shape {str(d['shape'])[:40]} has {many} ranks, more than a world's {MAX_MESH_RANKS}"
                )
            if type(first) is not int or first < 0 or not 0 < n or "ranks" in d:
                raise ValueError(
                    f"a mesh's first_rank {str(first)[:20]} or shape {str(d['shape'])[:40]} is out of range, "
                    f"or it lists ranks too"
                )
            # a range, not a tuple: a few bytes of manifest must not make millions of integers
            return cls(tuple(d["shape"]), range(first, first + n), _first=first)  # type: ignore[arg-type]
        return cls(tuple(d["shape"]), tuple(d["ranks"]))

    def problem(self, world_size: int) -> str | None:
        shape, ranks = self.shape, self.ranks
        if self._first is not None:  # consecutive ranks: distinct by construction
            if not shape or len(shape) > MAX_MESH_DIMS or not all(type(s) is int and s > 0 for s in shape):
                return f"a mesh's shape is not a list of at most {MAX_MESH_DIMS} positive integers"
            if self._first + len(ranks) > world_size:
                return f"a mesh's ranks from {self._first} are not {len(ranks)} ranks of the world of {world_size}"
            return None
        if not shape or len(shape) > MAX_MESH_DIMS or not all(type(s) is int and s > 0 for s in shape):
            return f"a mesh's shape is not a list of at most {MAX_MESH_DIMS} positive integers"
        if math.prod(shape) != len(ranks) or len(ranks) > MAX_MESH_RANKS:
            return f"a mesh of shape {list(shape)[:8]} lists {len(ranks)} ranks"
        if not all(type(r) is int and 0 <= r < world_size for r in ranks) or len(set(ranks)) != len(ranks):
            return f"a mesh's ranks are not distinct ranks of the world of {world_size}"
        return None

    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate of ``rank`` in the mesh, or None when it is not part of it."""
        if self._first is not None:
            i: int | None = rank - self._first if 0 <= rank - self._first < len(self.ranks) else None
        else:
            if not self._where:
                self._where.update({r: i for i, r in enumerate(self.ranks)})
            i = self._where.get(rank)
        if i is None:
            return None
        out = []
        for st in self.strides():
            c, i = divmod(i, st)
            out.append(c)
        return tuple(out)


Placements = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Rule:
    """How a described leaf is laid out: its mesh, a placement per mesh dimension, the order
    they apply in (None: mesh-dimension order) and the replica that writes each box."""

    mesh: Mesh
    placements: Placements
    replica: int = 0
    order: tuple[int, ...] | None = None

    def spec(self, mesh_index: int) -> list[Any]:
        """The manifest's ``layouts`` entry, with the mesh at ``mesh_index``."""
        out: list[Any] = [mesh_index, [list(p) for p in self.placements]]
        if self.order is not None and list(self.order) != list(range(len(self.placements))):
            out.append(list(self.order))
        return out


def placements_problem(placements: Any, mesh: Mesh, ndim: int, order: Any = None) -> str | None:
    """Why ``placements`` (JSON) is not a placement per mesh dimension of a tensor of
    ``ndim`` dimensions (applied in ``order``, a permutation of the mesh dimensions, or None),
    or None. (A flat partition's bounds depend on the tensor's size: ``flat_problem``.)"""
    if not isinstance(placements, (list, tuple)) or len(placements) != len(mesh.shape):
        return "a layout's placements are not one per mesh dimension"
    flats = [p for p in placements if isinstance(p, (list, tuple)) and p[:1] in ([FLAT], (FLAT,))]
    if flats:
        p = placements[0] if len(placements) == 1 else flats[0]
        if not (
            len(placements) == 1
            and order is None
            and len(p) == 3
            and type(p[1]) is int
            and type(p[2]) is int
            and p[1] >= 0
            and p[2] > 0
        ):
            return (
                f"a flat partition {str(p)[:40]} is not the only placement [{FLAT!r}, pos, part] "
                f"(pos >= 0, part > 0) of a 1-D mesh"
            )
        return None
    if order is not None and (
        not isinstance(order, (list, tuple))
        or sorted(order) != list(range(len(mesh.shape)))
        or not all(type(m) is int for m in order)
    ):
        return "a layout's order is not a permutation of its mesh dimensions"
    for p in placements:
        ok = isinstance(p, (list, tuple)) and (
            tuple(p) == (REPLICATE,) or (len(p) == 2 and p[0] == SHARD and type(p[1]) is int and 0 <= p[1] < ndim)
        )
        if not ok:
            return (
                f"placement {str(p)[:40]} is neither [{SHARD!r}, d] (d a dimension of the tensor) nor [{REPLICATE!r}]"
            )
    return None


def flat_problem(shape: Sequence[int], mesh: Mesh, placements: Placements) -> str | None:
    """Why a flat partition (checked by ``placements_problem``) cannot hold a tensor of
    ``shape``: its elements must end within the mesh's parts."""
    _, pos, part = placements[0]
    if pos + math.prod(shape) > part * mesh.shape[0]:
        return f"a flat partition at {pos} in {mesh.shape[0]} parts of {part} cannot hold {math.prod(shape)} elements"
    return None


def is_flat(placements: Placements) -> bool:
    """Whether ``placements`` are a flat partition (a lone ``["F", ...]``)."""
    return len(placements) == 1 and tuple(placements[0][:1]) == (FLAT,)


#: A box of a tensor (offsets, shape) and where its elements start in a flat range.
FlatBox = tuple[tuple[int, ...], tuple[int, ...], int]


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[FlatBox]:
    """Split flat elements ``[start, end)`` of a row-major ``shape`` into boxes, in order: a
    partial first row, whole rows, a partial last row, recursively (at most ``2 * ndim - 1``)."""
    out: list[FlatBox] = []
    _split(tuple(shape), start, end, (), 0, out)
    return out


def _split(
    shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], base: int, out: list[FlatBox]
) -> None:
    if start >= end:
        return
    lead = (1,) * len(prefix)
    if not shape:  # a 0-d tensor: one element
        out.append((prefix, lead, base))
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    if inner == 0:
        return
    first_full = -(-start // inner)  # the first row that starts at or after `start`
    last_full = end // inner  # rows [first_full, last_full) are whole
    if first_full > last_full:  # the range lies inside one row
        row = start // inner
        _split(rest, start - row * inner, end - row * inner, (*prefix, row), base, out)
        return
    if start < first_full * inner:  # a partial leading row
        row = start // inner
        _split(rest, start - row * inner, inner, (*prefix, row), base, out)
    if last_full > first_full:
        zeros = (0,) * len(rest)
        out.append(
            ((*prefix, first_full, *zeros), (*lead, last_full - first_full, *rest), base + first_full * inner - start)
        )
    if end > last_full * inner:  # a partial trailing row
        _split(rest, 0, end - last_full * inner, (*prefix, last_full), base + last_full * inner - start, out)


def flat_part(shape: Sequence[int], placements: Placements, c: int) -> tuple[int, int]:
    """The flat range ``[start, end)`` of a tensor of ``shape`` that coordinate ``c`` of a
    flat partition holds (empty: ``start == end``)."""
    _, pos, part = placements[0]
    n = math.prod(shape)
    lo, hi = max(c * part - pos, 0), min((c + 1) * part - pos, n)
    return (lo, hi) if lo < hi else (0, 0)


def flat_cell_boxes(
    shape: Sequence[int], placements: Placements, c: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes coordinate ``c`` of a flat partition holds, in flat order."""
    lo, hi = flat_part(shape, placements, c)
    return [(offs, box) for offs, box, _ in flat_range_boxes(shape, lo, hi)]


#: A saved box of a described leaf: the rank that wrote it, its offsets and its shape.
Cell = tuple[int, tuple[int, ...], tuple[int, ...]]


def flat_overlapping(
    shape: Sequence[int], mesh: Mesh, placements: Placements, offsets: Sequence[int], box: Sequence[int]
) -> Iterator[Cell]:
    """``overlapping_cells`` of a flat partition: the coordinates whose parts meet the flat
    extent of the box (its first to its last element), and of their boxes those that meet it."""
    _, pos, part = placements[0]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = sum(o * st for o, st in zip(offsets, strides))
    last = sum((o + b - 1) * st for o, b, st in zip(offsets, box, strides))
    for c in range((pos + first) // part, min((pos + last) // part, mesh.shape[0] - 1) + 1):
        for offs, size in flat_cell_boxes(shape, placements, c):
            if all(o < bo + bs and bo < o + s for o, s, bo, bs in zip(offs, size, offsets, box)):
                yield mesh.ranks[c], offs, size


def replicas(mesh: Mesh, placements: Placements) -> int:
    """How many ranks hold each box: the product of the replicating mesh dimensions."""
    return math.prod(s for s, p in zip(mesh.shape, placements) if p[0] == REPLICATE)


def replica_index(mesh: Mesh, placements: Placements, coord: Sequence[int]) -> int:
    """The replica index of the rank at ``coord`` (its replicating coordinates, row-major)."""
    out = 0
    for s, p, c in zip(mesh.shape, placements, coord):
        if p[0] == REPLICATE:
            out = out * s + c
    return out


def placement_order(placements: Placements, order: Sequence[int] | None) -> Sequence[int]:
    return range(len(placements)) if order is None else order


def cell_box(
    shape: Sequence[int],
    mesh: Mesh,
    placements: Placements,
    coord: Sequence[int],
    order: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box (offsets, shape) the rank at ``coord`` holds of a tensor of ``shape``."""
    start = [0] * len(shape)
    size = list(shape)
    for m in placement_order(placements, order):
        p = placements[m]
        if p[0] == SHARD:
            d = p[1]
            off, n = chunk_part(size[d], mesh.shape[m], coord[m])
            start[d] += off
            size[d] = n
    return tuple(start), tuple(size)


__all__ = [
    "Cell",
    "FLAT",
    "FlatBox",
    "MAX_MESH_RANKS",
    "Mesh",
    "Placements",
    "Rule",
    "REPLICATE",
    "SHARD",
    "cell_box",
    "chunk_part",
    "flat_cell_boxes",
    "flat_part",
    "flat_problem",
    "flat_overlapping",
    "flat_range_boxes",
    "is_flat",
    "placement_order",
    "placements_problem",
    "replica_index",
    "replicas",
]
