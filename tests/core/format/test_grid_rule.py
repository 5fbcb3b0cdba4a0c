"""The described-layout rule (format/grid.py) against torch's own placement arithmetic: every
coordinate's box equals the local shard torch computes, the writers' boxes tile the tensor,
and the cells found for a box are exactly those a brute-force scan finds."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard

from shardkeeper.core.format.cells import overlapping_cells
from shardkeeper.core.format.grid import Mesh, cell_box, chunk_part, replica_index, replicas
from shardkeeper.core.format.tiling import check_tiling_boxes

torch_utils = pytest.importorskip("torch.distributed.tensor._utils")


def _torch_box(shape, mesh_shape, coord, placements):
    local, offset = torch_utils._compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    return tuple(offset), tuple(local)


def _rule(placements):
    return tuple(("R",) if isinstance(p, Replicate) else ("S", p.dim) for p in placements)


CASES = [
    ((20, 12), (3,), [Shard(0)]),  # uneven rows (FSDP2 at world 3)
    ((5, 7), (8,), [Shard(0)]),  # more ranks than rows: empty shards
    ((36, 20), (4,), [Shard(1)]),  # columns (TP rowwise)
    ((36, 20), (2, 2), [Shard(0), Shard(1)]),  # 2-D
    ((37, 21), (2, 3), [Replicate(), Shard(0)]),  # HSDP
    ((37, 21), (3, 2), [Shard(0), Shard(0)]),  # one dimension split twice: nested
    ((9,), (2, 2, 2), [Shard(0), Replicate(), Shard(0)]),
    ((), (4,), [Replicate()]),  # a scalar
    ((0, 4), (2,), [Shard(0)]),  # no elements
    ((1536, 512), (16,), [Shard(0)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_every_coordinate_holds_the_box_torch_gives_it(shape, mesh_shape, placements) -> None:
    mesh = Mesh(tuple(mesh_shape), tuple(range(len(list(itertools.product(*map(range, mesh_shape)))))))
    rule = _rule(placements)
    for coord in itertools.product(*map(range, mesh_shape)):
        offs, box = cell_box(shape, mesh, rule, coord)
        t_offs, t_box = _torch_box(shape, mesh_shape, coord, placements)
        assert box == t_box, (coord, box, t_box)
        if 0 not in box:  # torch's offset of an empty shard is a convention, not a box
            assert offs == t_offs, (coord, offs, t_offs)


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_the_writers_boxes_tile_the_tensor_and_overlaps_match_a_scan(shape, mesh_shape, placements) -> None:
    n = 1
    for s in mesh_shape:
        n *= s
    ranks = list(range(n))
    random.Random(7).shuffle(ranks)  # mesh coordinates need not be ranks in order
    mesh = Mesh(tuple(mesh_shape), tuple(ranks))
    rule = _rule(placements)
    for replica in range(replicas(mesh, rule)):
        written = {}
        for coord in itertools.product(*map(range, mesh_shape)):
            if replica_index(mesh, rule, coord) != replica:
                continue
            offs, box = cell_box(shape, mesh, rule, coord)
            if 0 not in box:
                rank = mesh.ranks[sum(c * s for c, s in zip(coord, mesh.strides()))]
                assert mesh.coordinate(rank) == coord
                written[rank] = (offs, box)
        if all(shape):
            assert check_tiling_boxes("t", tuple(shape), list(written.values())) is None
        rng = random.Random(replica)
        for _ in range(30):
            lo = [rng.randrange(0, s) if s else 0 for s in shape]
            size = [rng.randrange(1, s - a + 1) if s else 0 for a, s in zip(lo, shape)]
            want = sorted(
                (r, o, b)
                for r, (o, b) in written.items()
                if all(oi < li + si and li < oi + bi for oi, bi, li, si in zip(o, b, lo, size))
            )
            got = sorted(overlapping_cells(shape, mesh, rule, replica, lo, size))
            assert got == (want if 0 not in size else []), (lo, size)


def test_chunk_rule_parts() -> None:
    assert [chunk_part(10, 4, c) for c in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [chunk_part(5, 8, c) for c in range(8)] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)] + [(5, 0)] * 3
    assert chunk_part(0, 3, 1) == (0, 0)


def test_a_large_mesh_finds_each_ranks_box() -> None:
    """16,384 ranks, more than there are rows: every rank's box is its own cell, found by the
    overlap search, and a box across all rows meets exactly the non-empty cells."""
    n = 16384
    mesh = Mesh((n,), tuple(reversed(range(n))))
    shape = (10000, 4)
    for c in (0, 1, 9999, 10000, n - 1):
        offs, box = cell_box(shape, mesh, (("S", 0),), (c,))
        if 0 in box:
            continue
        assert list(overlapping_cells(shape, mesh, (("S", 0),), 0, offs, box)) == [(n - 1 - c, offs, box)]
    assert len(list(overlapping_cells(shape, mesh, (("S", 0),), 0, (0, 0), shape))) == 10000


@pytest.mark.parametrize("shape,mesh_shape", [((20, 12), (2, 2)), ((22, 3), (3, 2)), ((7, 5), (2, 4))])
def test_fsdp2_over_tp_on_one_dimension_is_the_tp_split_first(shape, mesh_shape) -> None:
    """``[_StridedShard(0, sf=tp), Shard(0)]`` on a (dp, tp) mesh: the rule applies the TP
    split, then the DP split of each TP part (order (1, 0)); torch gives each coordinate that
    box (its size and first row; the box is one run of rows)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardkeeper.core.save.describe import _placements

    placements = [_StridedShard(0, split_factor=mesh_shape[1]), Shard(0)]
    rule, order, strided = _placements(tuple(placements))
    assert (rule, order, strided) == ((("S", 0), ("S", 0)), (1, 0), True)
    mesh = Mesh(tuple(mesh_shape), tuple(range(mesh_shape[0] * mesh_shape[1])))
    boxes = []
    for coord in itertools.product(*map(range, mesh_shape)):
        offs, box = cell_box(shape, mesh, rule, coord, order)
        t_offs, t_box = _torch_box(shape, mesh_shape, coord, placements)
        assert box == t_box and (0 in box or offs == t_offs), (coord, offs, box, t_offs, t_box)
        boxes.append((offs, box))
    assert check_tiling_boxes("t", shape, [b for b in boxes if 0 not in b[1]]) is None


FLAT_CASES = [
    ((7, 5), 4, 0, 9),  # ZeRO-3: one parameter chunked, the last part short
    ((3, 4, 6), 3, 11, 30),  # ZeRO-1/2: a parameter in mid-buffer, parts start mid-row
    ((11,), 5, 2, 3),
    ((), 2, 5, 4),  # a scalar in the second part
    ((300, 101), 4, 17, 7600),
    ((4, 0), 2, 0, 1),  # no elements
]


@pytest.mark.parametrize("shape,world,pos,part", FLAT_CASES)
def test_a_flat_partition_tiles_the_tensor_and_overlaps_match_a_scan(shape, world, pos, part) -> None:
    """``["F", pos, part]``: every element lies in exactly one box, the box of the coordinate
    whose part of the buffer holds it; the cells found for a box are those a scan finds."""
    from shardkeeper.core.format.grid import flat_cell_boxes, flat_problem, is_flat, placements_problem

    mesh = Mesh((world,), tuple(range(world)))
    pl = (("F", pos, part),)
    assert is_flat(pl) and placements_problem([["F", pos, part]], mesh, len(shape)) is None
    assert flat_problem(shape, mesh, pl) is None
    n = 1
    for s in shape:
        n *= s
    owner = {}
    for c in range(world):
        for offs, box in flat_cell_boxes(shape, pl, c):
            for idx in itertools.product(*(range(o, o + b) for o, b in zip(offs, box))):
                flat = 0
                for i, s in zip(idx, shape):
                    flat = flat * s + i
                assert idx not in owner, (idx, c)
                owner[idx] = c
                assert (pos + flat) // part == c
    assert len(owner) == n
    rng = random.Random(5)
    for _ in range(30):
        offs = tuple(rng.randrange(max(s, 1)) for s in shape)
        box = tuple(rng.randrange(1, max(s - o, 1) + 1) for s, o in zip(shape, offs))
        got = sorted(overlapping_cells(shape, mesh, pl, 0, offs, box))
        want = sorted(
            (c, o, b)
            for c in range(world)
            for o, b in flat_cell_boxes(shape, pl, c)
            if all(oo < bo + bs and bo < oo + ss for oo, ss, bo, bs in zip(o, b, offs, box))
        )
        assert got == want, (offs, box)


def test_flat_partitions_that_cannot_hold_their_tensor_are_refused() -> None:
    from shardkeeper.core.format.grid import flat_problem, placements_problem

    m1, m2 = Mesh((4,), (0, 1, 2, 3)), Mesh((2, 2), (0, 1, 2, 3))
    assert flat_problem((7, 5), m1, (("F", 0, 8),)) is not None  # 35 elements, 32 in the parts
    assert flat_problem((7, 5), m1, (("F", 0, 9),)) is None
    for bad in ([["F", -1, 9]], [["F", 0, 0]], [["F", 0]], [["F", 0.5, 9]], [["F", 0, True]]):
        assert placements_problem(bad, m1, 2) is not None, bad
    why = placements_problem([["R"], ["F", 0, 9]], m2, 2)  # not alone on a 1-D mesh: named
    assert why is not None and "('F', 0, 9)" in why.replace("[", "(").replace("]", ")"), why
    assert placements_problem([["F", 0, 9]], m1, 2, order=[0]) is not None
