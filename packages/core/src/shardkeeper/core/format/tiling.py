"""Exact tiling of a tensor by boxes (docs/format.md 5.2), checked in near-linear time.

``check_tiling_boxes`` decides whether boxes tile a tensor exactly with the *signed-corner
test*. In one dimension the indicator of ``[a, b)`` is ``H(x - a) - H(x - b)``, with ``H(t)``
1 for ``t >= 0`` and 0 otherwise. In ``d`` dimensions the indicator of the box ``[a, b)`` is
the product of those, which expands to a sum over its ``2**d`` corners ``c`` (``c[i]`` is
``a[i]`` or ``b[i]``) of ``sign(c) * O_c(x)``, where ``sign(c)`` is -1 to the number of
coordinates taken from ``b`` and ``O_c`` is the indicator of the orthant ``{x : x >= c}``
(componentwise). So the coverage count ``f(x)`` (how many boxes hold ``x``) is
``sum_c w(c) O_c(x)``, with ``w`` the signed multiset of every box's corners after cancelling,
and the tensor's own indicator ``1_T`` is the same sum over its ``2**d`` corners.

Orthant indicators at distinct points are linearly independent: if ``sum_c D(c) O_c = 0``
with some ``D(c)`` nonzero, take the lexicographically least such ``c*``; no other ``c`` with
``D(c)`` nonzero is ``<= c*`` componentwise (it would be lexicographically smaller), so the
sum at ``x = c*`` is ``D(c*)``, not 0. Hence ``f == 1_T`` (every element of the tensor
covered exactly once, nothing outside covered) if and only if ``w`` equals the tensor's
signed corners. The lexicographically least corner where they differ is an element that
shows the failure: there ``f - 1_T`` equals the difference, and (all boxes lying inside the
tensor) it lies inside the tensor, covered by no chunk or by two.

Two reductions keep the work small: a dimension that every box spans whole contributes the
same factor to ``f`` and ``1_T``, so it is dropped (a tensor split along one dimension, e.g.
into columns, needs two corners a box); an empty box's corners cancel, so it is skipped. The
work is ``boxes * 2**d`` for the ``d`` dimensions left; above ``MAX_TILING_CORNERS`` the
layout is refused as damage (no writer splits a tensor along more than a few dimensions).
Row sharding (slabs along dimension 0, the common case) is recognized before any of this by
``table.all_slabs`` and ``table.leaf_chunks_problem``.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

#: Most corners (boxes x 2**dimensions split) the tiling check of one tensor counts: a few
#: seconds of work. A legitimate layout splits a tensor along one to three dimensions.
MAX_TILING_CORNERS = 1 << 24


def check_tiling_boxes(
    key: str, shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> str | None:
    """Return why the ``(offsets, shape)`` boxes do not tile ``shape`` exactly, or None.

    Exact tiling: every box lies inside the tensor, boxes are pairwise disjoint, and their
    volumes add up to the tensor's. Identical duplicate boxes are the caller's to drop first.
    """
    total = math.prod(shape)
    ndim = len(shape)
    if len(boxes) == 1:  # the common case: one whole chunk
        offs, bshape = boxes[0]
        if len(offs) == ndim and len(bshape) == ndim and not any(offs) and list(bshape) == list(shape):
            return None
    vol = 0
    for offs, bshape in boxes:
        if len(offs) != ndim or len(bshape) != ndim:
            return f"chunk at {list(offs)} has rank {len(bshape)}, tensor has {ndim}"
        for o, n, g in zip(offs, bshape, shape):
            if o < 0 or n < 0 or o + n > g:
                return f"chunk {list(offs)}+{list(bshape)} lies outside shape {list(shape)}"
        vol += math.prod(bshape)
    if vol != total:
        return f"chunks cover {vol} of {total} elements"
    if len(boxes) == 1 or total == 0:
        return None
    nonempty = [(tuple(o), tuple(n)) for o, n in boxes if 0 not in n]
    if ndim == 0:
        return None if len(nonempty) == 1 else "scalar stored more than once"
    return _corners_problem(key, tuple(shape), nonempty)


def _corners_problem(
    key: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> str | None:
    """The signed-corner test (module docstring) for in-bounds, non-empty boxes whose volumes
    add up to the tensor's."""
    starts = list(zip(*[o for o, _ in boxes]))  # per dimension, every box's first index
    sizes = list(zip(*[n for _, n in boxes]))
    split = [d for d in range(len(shape)) if any(starts[d]) or sizes[d].count(shape[d]) != len(boxes)]
    k = len(split)
    if k == 0:  # every box is the whole tensor: with the volumes equal, there is one
        return None
    work = len(boxes) << k
    if work > MAX_TILING_CORNERS:
        return (
            f"{len(boxes)} chunks split the tensor along {k} dimensions: checking that they tile it "
            f"takes {work} steps, more than the {MAX_TILING_CORNERS} a reader spends on one tensor "
            f"(no writer makes such a layout)"
        )
    lo = [starts[d] for d in split]
    hi = [tuple(map(operator.add, starts[d], sizes[d])) for d in split]
    pos: Counter[object] = Counter()  # corners with sign +1 (even count of upper coordinates)
    neg: Counter[object] = Counter()
    for mask in range(1 << k):
        cols = [hi[j] if mask >> j & 1 else lo[j] for j in range(k)]
        odd = bin(mask).count("1") & 1
        (neg if odd else pos).update(cols[0] if k == 1 else zip(*cols))
        # the tensor's corner of this pattern, on the other side: pos - neg == tensor's corners
        corner = tuple(shape[split[j]] if mask >> j & 1 else 0 for j in range(k))
        (pos if odd else neg)[corner[0] if k == 1 else corner] += 1
    if pos == neg:
        return None
    diff = pos.copy()
    diff.subtract(neg)
    least: Any = min(cast(Any, c) for c, v in diff.items() if v)  # an int (k == 1) or a tuple of ints
    at = [0] * len(shape)
    for j, d in enumerate(split):
        at[d] = least if k == 1 else least[j]
    holders = [o for o, n in boxes if all(a <= x < a + s for a, s, x in zip(o, n, at))]
    if len(holders) >= 2:
        return f"chunks {list(holders[0])} and {list(holders[1])} of {key} overlap (both hold element {at})"
    return (
        f"no chunk of {key} holds element {at}, although the chunks' element counts add up to "
        f"the tensor's: some chunks overlap"
    )


__all__ = ["MAX_TILING_CORNERS", "check_tiling_boxes"]
