"""The checks of a table-form manifest that relate its tables to each other and to its
files: every leaf's rows tile its shape exactly with the right lengths (``all_slabs``, the
common case in a few passes; ``leaf_chunks_problem``, leaf by leaf), encoded rows are known
and bounded (``encoded_rows_problem``), and rows lie inside their files (``tables_problem``,
what ``TableLeaves.problem`` runs). Linear in the number of rows where the layout allows.

Layering: above the columns (format/columns.py) and the records' checks
(format/records.py), below the leaves made from the tables (format/table.py) and the
manifest's assembly (commit/merge.py), which both run these checks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from shardkeeper.core.format.columns import ChunkTable, expand, gather
from shardkeeper.core.format.features import ENCODINGS
from shardkeeper.core.format.leaf_table import LeafTable
from shardkeeper.core.format.records import DTYPES, NOT_A_DATA_FILE, encoded_length_problem, safe_chunk_path
from shardkeeper.core.format.tiling import check_tiling_boxes


def all_slabs(
    shapes: Sequence[Sequence[int]],
    iszs: Sequence[int],
    counts: Sequence[int],
    perm: Sequence[int],
    t: ChunkTable,
    *,
    check_lengths: bool,
) -> bool:
    """True if every leaf ``j`` (``shapes[j]``, item size ``iszs[j]``, whose rows are the
    next ``counts[j]`` of ``perm``) has rows that are slabs along dimension 0 listed in order
    (row sharding, FSDP, or one whole chunk) tiling its shape exactly, with raw lengths: the
    common case, checked in a few passes over all rows, in C where the rows share one number
    of dimensions. False means "check leaf by leaf" (``leaf_chunks_problem``), not
    necessarily an error."""
    if 0 in counts or not all(shapes) or len(perm) != sum(counts):
        return False
    if not perm:
        return True
    first = list(accumulate(counts[:-1], initial=0))  # position in perm of each leaf's first row
    nds = set(map(len, shapes))
    nd = len(shapes[0])
    if nds == {nd} and t.ndim.count(nd) == len(t):
        # Dimension d of every row is the column slice offsets[d::nd]; gathers run in C.
        for d in range(1, nd):
            if any(t.offsets[d::nd]):
                return False
            if gather(t.shape[d::nd], perm) != expand(list(map(operator.itemgetter(d), shapes)), counts):
                return False
        o0 = gather(t.offsets[0::nd], perm)
        n0 = gather(t.shape[0::nd], perm)
    else:
        if gather(t.ndim, perm) != expand(list(map(len, shapes)), counts):
            return False  # a row of another number of dimensions than its leaf
        dims, toffs, tshape = t.dims, t.offsets, t.shape
        starts = gather(dims, perm)
        ends = [dims[i + 1] for i in perm]
        rest = expand([tuple(s[1:]) for s in shapes], counts)
        if [tuple(tshape[a + 1 : b]) for a, b in zip(starts, ends)] != rest:
            return False  # also catches another number of dimensions
        if any([any(toffs[a + 1 : b]) for a, b in zip(starts, ends)]):
            return False
        o0 = gather(toffs, starts)
        n0 = gather(tshape, starts)
    if 0 in n0:
        return False
    stop = list(map(operator.add, o0, n0))
    expect = [0, *stop[:-1]]  # each slab starts where the previous one ends ...
    for k in first:
        expect[k] = 0  # ... and each leaf's first one at 0
    if o0 != expect:
        return False
    last = [k - 1 for k in [*first[1:], len(perm)]]
    if gather(stop, last) != list(map(operator.itemgetter(0), shapes)):
        return False
    if check_lengths:
        row_bytes = expand([math.prod(s[1:]) * isz for s, isz in zip(shapes, iszs)], counts)
        if gather(t.length, perm) != list(map(operator.mul, n0, row_bytes)):
            return False
    return True


def leaf_chunks_problem(
    key: str, shape: Sequence[int], isz: int, rows: Sequence[int], t: ChunkTable, *, check_lengths: bool = True
) -> str | None:
    """Why rows ``rows`` of ``t`` are not the chunks of a leaf of ``shape`` (dimensions,
    raw lengths, exact tiling), or None. Gathers columns with list comprehensions and
    recognizes slabs along dimension 0 (row sharding, FSDP) and whole chunks without a
    per-chunk loop; other layouts go through ``check_tiling_boxes``."""
    nd = len(shape)
    ndims = t.ndim
    if [ndims[i] for i in rows] != [nd] * len(rows):
        return f"a chunk has another number of dimensions than the tensor ({nd})"
    dims, toffs, tshape, lengths = t.dims, t.offsets, t.shape, t.length
    starts = [dims[i] for i in rows]
    slab = nd >= 1
    for d in range(1, nd):
        if any([toffs[a + d] for a in starts]) or [tshape[a + d] for a in starts] != [shape[d]] * len(starts):
            slab = False
            break
    if slab:
        n0 = [tshape[a] for a in starts]
        if check_lengths:
            row_bytes = math.prod(shape[1:]) * isz
            if [lengths[i] for i in rows] != [n * row_bytes for n in n0]:
                return "a chunk's length is not its element count times the item size"
        if _slabs_tile(zip([toffs[a] for a in starts], n0), shape[0]):
            return None
    boxes = [(toffs[a : a + nd], tshape[a : a + nd]) for a in starts]
    if check_lengths and not slab:
        for i, (_, cshape) in zip(rows, boxes):
            if lengths[i] != math.prod(cshape) * isz:
                return f"chunk of shape {cshape} has {lengths[i]} bytes"
    return check_tiling_boxes(key, shape, boxes)


def _slabs_tile(slabs: Iterable[tuple[int, int]], rows: int) -> bool:
    """Whether the (first row, row count) slabs, in any order, tile rows [0, rows) exactly."""
    at = 0
    for o, n in sorted(slabs):
        if o != at or n <= 0:
            return False
        at = o + n
    return at == rows


def leaf_table_slabs(lt: LeafTable, t: ChunkTable, *, check_lengths: bool) -> bool:
    """``all_slabs`` over every leaf of ``lt``."""
    isz = {d: DTYPES[d][1] for d in set(lt.dtype)}
    return all_slabs(
        lt.shapes(), list(map(isz.__getitem__, lt.dtype)), lt.nrows, lt.rows, t, check_lengths=check_lengths
    )


def encoded_rows_problem(lt: LeafTable, t: ChunkTable) -> str | None:
    """The checks of ``Manifest.problem`` on the rows of a table with an ``encoding`` column:
    a raw row's length is its box's bytes; an encoded row's encoding is known, its length
    positive and within what its box allows (``records.encoded_length_problem``)."""
    encoding, dims, shape, length = t.extras["encoding"], t.dims, t.shape, t.length
    for key, _, isz, rows in lt.items():
        for i in rows:
            box = math.prod(shape[dims[i] : dims[i + 1]]) * isz
            enc = encoding[i]
            if enc is None or enc == "raw":
                if length[i] != box:
                    return f"{key}: chunk_table row {i} has {length[i]} bytes, its box {box}"
                continue
            if enc not in ENCODINGS:
                return f"{key}: unknown chunk encoding {enc[:40]!r}"
            why = "encoded chunk without bytes" if length[i] == 0 else encoded_length_problem(enc, length[i], box)
            if why is not None:
                return f"{key}: chunk_table row {i}: {why}"
    return None


def tables_problem(
    objects: Mapping[str, Any], lt: LeafTable, t: ChunkTable, block: int, files: Mapping[str, Any]
) -> str | None:
    """Why the leaves of a table-form manifest (``objects``: its object leaves, ``lt`` over
    ``t``, in digest blocks of ``block`` bytes) cannot be trusted, or None (see
    ``Manifest.problem``); linear in the number of rows."""
    why = t.problem(block)
    if why is not None:
        return why
    for p in t.paths:
        if not safe_chunk_path(p):
            return f"chunk file {p[:80]!r} {NOT_A_DATA_FILE}"
    big = 1 << 62
    ends = []
    for p in t.paths:
        rec = files.get(p)  # absent: a reference into another step's files
        size = big if rec is None else rec.get("size_bytes", -1)
        ends.append(size if type(size) is int else -1)
    if any(map(operator.gt, map(operator.add, t.offset, t.length), gather(ends, t.file))):
        for f, o, n in zip(t.file, t.offset, t.length):
            if o + n > ends[f]:
                return f"chunk [{o}, {o + n}) lies beyond the end of {t.paths[f][:80]!r}"
    why = lt.problem(len(t))
    if why is not None:
        return why
    if len(set(lt.rows)) != len(lt.rows):
        return "a chunk_table row belongs to more than one leaf (or twice to one)"
    for key, d in objects.items():
        if not (isinstance(d, dict) and d.get("kind") == "object"):
            return f"{key}: a leaf outside the leaf table that is not an object"
        if "value" not in d:
            return f"{key}: an object leaf without a value"
        if key in lt.index:
            return f"{key}: both an object and a tensor leaf"
    nd = lt.ndim[0] if lt.ndim else 0
    uniform = lt.ndim.count(nd) == len(lt.ndim) and t.ndim.count(nd) == len(t.ndim)  # in C
    if not uniform and gather(t.ndim, lt.rows) != expand(lt.ndim, lt.nrows):
        for key, shape, _, rows in lt.items():
            for i in rows:
                if t.ndim[i] != len(shape):
                    return f"{key}: chunk_table row {i} has {t.ndim[i]} dimensions, the leaf has {len(shape)}"
    check_lengths = "encoding" not in t.extras
    if not check_lengths:  # raw rows' lengths and encoded rows' bounds, row by row
        why = encoded_rows_problem(lt, t)
        if why is not None:
            return why
    if leaf_table_slabs(lt, t, check_lengths=check_lengths):
        return None
    for key, shape, isz, rows in lt.items():
        why = leaf_chunks_problem(key, shape, isz, rows, t, check_lengths=check_lengths)
        if why is not None:
            return f"{key}: {why}"
    return None


__all__ = ["all_slabs", "encoded_rows_problem", "leaf_chunks_problem", "leaf_table_slabs", "tables_problem"]
