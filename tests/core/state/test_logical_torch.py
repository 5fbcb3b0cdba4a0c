"""Logical partials computed by torch ops on the tensor's device (state/logical_torch.py),
run here on CPU tensors (the same ops run on CUDA: tests/cuda/test_cuda_logical.py): bit for
bit ``format.logical.box_sum`` of the shard's bytes, for every format dtype, any box and any
local layout (column shards, strided and permuted views), in pieces of any size, and the
partials of a tiling add up to the whole tensor's sum."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkeeper.core import logical_digest
from shardkeeper.core.format import logical
from shardkeeper.core.state.logical_torch import CHUNK_BYTES, device_partial, device_partials, multipliers

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
]
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Piece sizes as fractions of the shard: whole (the default size), about a third, a tenth,
#: a fiftieth (a byte at least: an element a piece).
SPLITS = [0, 3, 10, 50]


def chunk_for(t: torch.Tensor, split: int) -> int:
    return CHUNK_BYTES if not split else max(1, t.numel() * t.element_size() // split)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaN patterns included); 0 and 1 for bool."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 2 if dtype == torch.bool else 256, (math.prod(shape) * size,), generator=g, dtype=torch.uint8
    )
    return raw.view(dtype).reshape(shape)


def host_sum(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The definition's sum through the numpy path, from the shard's host bytes."""
    flat = torch.empty(local.numel(), dtype=local.dtype).copy_(local.reshape(-1))  # strides 1, whatever local's
    raw = flat.view(torch.uint8).numpy().tobytes()
    return logical.box_sum(raw, local.element_size(), shape, offsets, tuple(local.shape))


def laid_out(box: torch.Tensor, how: str) -> torch.Tensor:
    """The same elements as ``box`` held in another layout: a column of a wider buffer,
    every other row of a taller one, or a permuted contiguous tensor permuted back."""
    if how == "contiguous" or box.dim() == 0:
        return box
    if how == "column":
        wide = torch.zeros((*box.shape[:-1], box.shape[-1] + 3), dtype=box.dtype)
        wide[..., 1 : 1 + box.shape[-1]] = box
        return wide[..., 1 : 1 + box.shape[-1]]
    if how == "step":
        tall = torch.zeros((box.shape[0] * 2, *box.shape[1:]), dtype=box.dtype)
        tall[::2] = box
        return tall[::2]
    order = list(reversed(range(box.dim())))
    return box.permute(order).contiguous().permute(order)


@st.composite
def boxes(draw: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """A global tensor, a box of it (offsets), and the box's elements in some layout."""
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    last = draw(st.sampled_from([1, 2, 3, 5, 7, 9, 31, 32, 33, 64, 96, 130]))
    empty = draw(st.sampled_from([False] * 9 + [True]))  # a tenth of the boxes hold no element
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim - 1)) + ((last,) if ndim else ())
    full = random_tensor(shape, dtype, draw(st.integers(0, 2**31)))
    offsets, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n if empty else n - 1))
        offsets.append(o)
        sizes.append(draw(st.integers(0 if empty else 1, n - o)))
    box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    how = draw(st.sampled_from(["contiguous", "column", "step", "permuted"]))
    return full, tuple(offsets), tuple(sizes), laid_out(box, how)


@FUZZ
@given(boxes(), st.sampled_from(SPLITS))
def test_a_box_in_any_layout_sums_as_the_numpy_definition(
    case: tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], torch.Tensor], split: int
) -> None:
    full, offsets, _, local = case
    shape = tuple(full.shape)
    got = device_partial(local, shape, offsets, chunk_bytes=chunk_for(local, split))
    assert got == host_sum(local, shape, offsets)


@st.composite
def tilings(draw: Any) -> tuple[torch.Tensor, list[tuple[torch.Tensor, tuple[int, ...]]]]:
    """A tensor and the views of a grid of uneven boxes that tile it."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    full = random_tensor(shape, dtype, draw(st.integers(0, 2**31)))
    cuts = []
    for n in shape:
        inner = sorted(set(draw(st.lists(st.integers(1, n), max_size=3))))
        cuts.append([0, *[c for c in inner if c < n], n])
    tiles = []
    for idx in torch.cartesian_prod(*[torch.arange(len(c) - 1) for c in cuts]).reshape(-1, len(shape)).tolist():
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        hi = tuple(cuts[d][i + 1] for d, i in enumerate(idx))
        tiles.append((full[tuple(slice(a, b) for a, b in zip(lo, hi))], lo))
    return full, tiles


@FUZZ
@given(tilings(), st.sampled_from(SPLITS))
def test_the_partials_of_a_tiling_add_up_to_the_whole_tensors_digest(
    case: tuple[torch.Tensor, list[tuple[torch.Tensor, tuple[int, ...]]]], split: int
) -> None:
    full, tiles = case
    shape = tuple(full.shape)
    parts = device_partials([(t, shape, o) for t, o in tiles], chunk_bytes=chunk_for(full, split * 4))
    assert parts == [host_sum(t, shape, o) for t, o in tiles]
    total = logical.combine_sums(parts)
    assert total == device_partial(full, shape, (0,) * len(shape)) == host_sum(full, shape, (0,) * len(shape))
    name = str(full.dtype).removeprefix("torch.")
    assert logical.finalize(name, shape, total) == logical_digest(full)


def test_the_format_documents_test_vectors() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert device_partial(t, (2, 3), (0, 0)) == 0xA631A3E3D6E443E0
    assert device_partial(t[1:], (2, 3), (1, 0)) == 0x4E76FFBC32F79560
    assert device_partial(torch.empty(0, dtype=torch.uint8), (0,), (0,)) == 0
    assert device_partial(torch.tensor([True, False, True]), (3,), (0,)) == host_sum(
        torch.tensor([True, False, True]), (3,), (0,)
    )


def test_the_block_multipliers_are_splitmix64_modulo_2_64() -> None:
    """Blocks far out (indices past 2^40) and the int64 wraparound of every step."""
    k = torch.tensor([0, 1, 2, 63, 64, 1 << 20, (1 << 40) + 12345, (1 << 62) - 1], dtype=torch.int64)
    got = [x & (2**64 - 1) for x in multipliers(k).tolist()]
    assert got == [logical.block_multiplier(int(x)) for x in k.tolist()]


@pytest.mark.parametrize(
    "dtype, shape, index",
    [
        (torch.bfloat16, (300, 1000), (slice(None), slice(100, 355))),  # a column shard, aligned rows
        (torch.float32, (257, 301), (slice(3, 250), slice(7, 299))),  # rows at every phase
        (torch.uint8, (123, 77, 5), (slice(2, 120), slice(1, 70), slice(1, 4))),  # 3 split dims
        (torch.int64, (1 << 18,), (slice(999, (1 << 18) - 5),)),  # one long run, odd phase
        (torch.float8_e5m2, (70_000,), (slice(1, 69_999),)),
    ],
)
def test_larger_shards_in_small_pieces(dtype: torch.dtype, shape: tuple[int, ...], index: tuple[slice, ...]) -> None:
    full = random_tensor(shape, dtype, 7)
    local = full[index]
    offsets = tuple(s.indices(n)[0] for s, n in zip(index, shape))
    want = host_sum(local, shape, offsets)
    for chunk in (4096, 100_000, None):
        assert device_partial(local, shape, offsets, chunk_bytes=chunk) == want


def test_many_small_tensors_go_in_batches_with_the_same_sums() -> None:
    """Thousands of single-run shards (batched) beside multi-row and empty ones, in one call."""
    shards: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []
    for i in range(3000):
        dtype = DTYPES[i % len(DTYPES)]
        n = 1 + (i * 37) % 200
        full = random_tensor((n + 10,), dtype, i)
        shards.append((full[i % 10 : i % 10 + n], (n + 10,), (i % 10,)))
    big = random_tensor((40, 50), torch.float16, 1)
    shards += [(big[:, 3:20], (40, 50), (0, 3)), (torch.empty(0, 4), (3, 4), (3, 0))]
    got = device_partials(shards, chunk_bytes=1 << 16)
    assert got == [host_sum(t, s, o) for t, s, o in shards]


def test_bad_input_is_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match="complex64 has no logical digest"):
        device_partial(torch.zeros(2, dtype=torch.complex64), (2,), (0,))
    with pytest.raises(ValueError, match="is not inside shape"):
        device_partial(torch.zeros(3), (4,), (2,))
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        device_partial([1.0], (1,), (0,))  # type: ignore[arg-type]
