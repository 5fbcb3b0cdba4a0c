"""Which saved boxes of a described leaf meet a box (``overlapping_cells``): the rule of
format/grid.py run backwards, one part of each dimension at a time, so that a restoring rank
finds the few cells it needs without listing a leaf's every chunk."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

from shardkeeper.core.format.grid import (
    REPLICATE,
    SHARD,
    Cell,
    Mesh,
    Placements,
    chunk_part,
    flat_overlapping,
    is_flat,
    placement_order,
)

#: A part of one tensor dimension: its coordinate along each splitting mesh dim, start, size.
Part = tuple[tuple[int, ...], int, int]
_T = TypeVar("_T")


def _dim_options(length: int, splits: Sequence[tuple[int, int]], lo: int, hi: int) -> Iterator[Part]:
    """The parts of ``[0, length)`` under the nested splits ``(mesh dim, ways)`` that meet
    ``[lo, hi)``, in coordinate order, one at a time: found directly (the parts a range meets
    are a run of indices: no loop over every part), and every part a level visits leads to at
    least one part below it (it meets ``[lo, hi)``), so no work is spent on parts not given."""

    def walk(level: int, coords: tuple[int, ...], st: int, n: int) -> Iterator[Part]:
        ways, last = splits[level][1], level == len(splits) - 1
        full = -(-n // ways) if n else 0
        a, b = max(lo - st, 0), min(hi - st, n)
        if full == 0 or a >= b:
            return
        for c in range(a // full, min(ways - 1, (b - 1) // full) + 1):
            off, sz = chunk_part(n, ways, c)
            if sz and last:
                yield (*coords, c), st + off, sz
            elif sz:
                yield from walk(level + 1, (*coords, c), st + off, sz)

    return walk(0, (), 0, length) if splits else iter((((), 0, length),))


def _product(makers: Sequence[Callable[[], Iterator[_T]]]) -> Iterator[tuple[_T, ...]]:
    """``itertools.product`` of the iterators ``makers`` make, without listing them first (as
    ``itertools.product`` does): an odometer, whose later iterators are made again each time
    an earlier one moves on (each is the same again: it depends on none of the others)."""
    its = [make() for make in makers]
    cur = [next(it, None) for it in its]
    if any(c is None for c in cur):  # one is empty: so is the product
        return
    yield tuple(cur)  # type: ignore[arg-type]
    d = len(its) - 1
    while d >= 0:
        got = next(its[d], None)
        if got is None:
            d -= 1
            continue
        cur[d] = got
        for e in range(d + 1, len(its)):  # (each non-empty: its first item was found above)
            its[e] = makers[e]()
            cur[e] = next(its[e])
        d = len(its) - 1
        yield tuple(cur)  # type: ignore[arg-type]


def overlapping_cells(
    shape: Sequence[int],
    mesh: Mesh,
    placements: Placements,
    replica: int,
    offsets: Sequence[int],
    box: Sequence[int],
    order: Sequence[int] | None = None,
) -> Iterator[Cell]:
    """Every non-empty saved box of a described leaf that meets the box ``offsets``/``box``,
    as (the rank that wrote it, its offsets, its shape), one at a time (module docstring)."""
    if 0 in box:
        return
    if is_flat(placements):
        yield from flat_overlapping(shape, mesh, placements, offsets, box)
        return
    by_dim: list[list[tuple[int, int]]] = [[] for _ in shape]
    for m in placement_order(placements, order):
        p = placements[m]
        if p[0] == SHARD:
            by_dim[p[1]].append((m, mesh.shape[m]))
    coord = [0] * len(mesh.shape)
    rest = replica  # the replicating coordinates, last one fastest
    for m in reversed(range(len(mesh.shape))):
        if placements[m][0] == REPLICATE:
            rest, coord[m] = divmod(rest, mesh.shape[m])
    makers = [partial(_dim_options, shape[d], by_dim[d], offsets[d], offsets[d] + box[d]) for d in range(len(shape))]
    strides = mesh.strides()
    for combo in _product(makers):
        for d, (coords, _, _) in enumerate(combo):
            for (m, _), c in zip(by_dim[d], coords):
                coord[m] = c
        rank = mesh.ranks[sum(c * s for c, s in zip(coord, strides))]
        yield rank, tuple(o[1] for o in combo), tuple(o[2] for o in combo)


__all__ = ["Part", "overlapping_cells"]
