"""Logical partial sums (docs/format.md, "Logical digests") computed by torch ops on the
tensor's own device: a CUDA shard is summed on the GPU, never copied to the host, with the
same result, bit for bit, as ``format.logical.box_sum`` over its bytes.

The shard is cut into pieces of at most ``chunk_bytes`` (each a box of the global tensor: a
slice along one dimension under fixed indices of the ones before it), so the extra device
memory stays bounded: at most about ``9.5 * chunk_bytes`` (a piece's copy when the shard is
not contiguous, its lanes as float64, per-block temporaries), 76 MiB at the default 8 MiB;
``6.5 * chunk_bytes`` for dtypes of 2 bytes or more (one float64 per 16-bit lane). A
piece is a set of runs of consecutive global lanes (its rows). When every row starts at the
same phase within a block of 64 lanes (a whole tensor, a row shard, a column shard whose
global rows span whole blocks), each row is padded to whole blocks in a float64 buffer and
one matrix-vector product gives every block's ``sum a[j] * v[j]`` (exact in any order: 64
products below 2^47); otherwise (narrow columns of rows of odd length) each lane's term is
formed on its own, from pieces 8 times smaller. The block multipliers ``M[k]`` are
splitmix64 in int64 arithmetic (torch's int64 multiply and sum wrap modulo 2^64, as the
definition's do; the logical right shifts are masked arithmetic ones).

Many small single-run shards (a state of thousands of biases) go together: their bytes,
padded to whole blocks, in one buffer, one product and one prefix sum per batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from shardkeeper.core.format import logical
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.flatten import torch_dtype_name

#: Bytes of a shard processed at a time on a GPU (see the module's docstring for the memory
#: it takes), and on the CPU (where smaller temporaries were measured faster).
CHUNK_BYTES = 8 << 20
CPU_CHUNK_BYTES = 1 << 20
#: Single-run shards of at most this many bytes are summed in batches.
SMALL_BYTES = 64 << 10
_B = logical.BLOCK
_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """The int64 with the bits of the uint64 ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


#: splitmix64's constants as int64; the first also adds M's base, 2^63.
_ADD = _signed((1 << 63) + 0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _xor_lsr(z: torch.Tensor, s: int) -> None:
    """``z ^= z >> s`` (logical shift) in place."""
    t = z >> s
    t &= (1 << (64 - s)) - 1
    z ^= t


def multipliers(k: torch.Tensor) -> torch.Tensor:
    """``M[k]`` (``format.logical.block_multiplier``) of int64 block indices, as int64."""
    z = k + _ADD
    _xor_lsr(z, 30)
    z *= _MUL1
    _xor_lsr(z, 27)
    z *= _MUL2
    _xor_lsr(z, 31)
    z |= 1
    return z


_WEIGHTS: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
#: 16-bit lanes are summed as ``int16(v ^ 0x8000) = v - 2^15`` (a copy at 2 bytes a lane, where
#: correcting a signed view would take passes over the float64 values): each block's sum is
#: then short by ``2^15 * sum(a)``, added back (every term below 2^46 in magnitude, every
#: partial sum below 2^53: exact in any order).
_FLIP = -(1 << 15)


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` as float64 (exact) and as int64, on ``device``."""
    key = (device.type, device.index)
    got = _WEIGHTS.get(key)
    if got is None:
        a = [logical.lane_weight(j) for j in range(_B)]
        got = (torch.tensor(a, dtype=torch.float64, device=device), torch.tensor(a, dtype=torch.int64, device=device))
        _WEIGHTS[key] = got
    return got


_SHIFT = float(-_FLIP * sum(logical.lane_weight(j) for j in range(_B)))  # 2^15 * sum(a): below 2^52


class _Rows:
    """A box as rows: ``count`` runs of ``width`` lanes, run ``r`` starting at the global lane
    ``base + sum_d i_d * step_d`` for ``r``'s indices ``i_d`` over ``outer`` (size, step)."""

    def __init__(self, shape: Sequence[int], offsets: Sequence[int], size: Sequence[int], per: int) -> None:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        split = [d for d in range(len(shape)) if size[d] != shape[d]]
        d0 = split[-1] if split else -1
        self.width = (size[d0] * strides[d0] if d0 >= 0 else math.prod(size)) * per
        self.outer = [(size[d], strides[d] * per) for d in range(max(d0, 0)) if size[d] > 1]
        self.count = math.prod(n for n, _ in self.outer)
        self.base = sum(o * s for o, s in zip(offsets, strides)) * per
        #: every run starts at the same phase within its block
        self.aligned = all(step % _B == 0 for _, step in self.outer)

    def starts(self, device: torch.device) -> torch.Tensor:
        """Each run's first global lane (int64)."""
        r = torch.arange(self.count, dtype=torch.int64, device=device)
        out = torch.full((self.count,), self.base, dtype=torch.int64, device=device)
        for n, step in reversed(self.outer):
            out += (r % n) * step
            r = r.div(n, rounding_mode="floor")
        return out


def _pieces(
    t: torch.Tensor, offsets: Sequence[int], limit: int
) -> Iterator[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """``t`` (the box at ``offsets``) as boxes of at most ``limit`` bytes (a single element
    where one is larger): ``(view, offsets, size)``, along the first dimension ``m`` whose
    slices fit, under each index of the dimensions before it."""
    size = tuple(t.shape)
    if not size:
        yield t, tuple(offsets), size
        return
    s = t.element_size()
    m = 0
    while m < len(size) - 1 and math.prod(size[m + 1 :]) * s > limit:
        m += 1
    rows = max(1, limit // (math.prod(size[m + 1 :]) * s))
    for prefix in np.ndindex(*size[:m]):
        sub = t[prefix] if m else t
        head = [o + i for o, i in zip(offsets, prefix)]
        for a in range(0, size[m], rows):
            b = min(size[m], a + rows)
            yield sub[a:b], (*head, offsets[m] + a, *offsets[m + 1 :]), (*(1,) * m, b - a, *size[m + 1 :])


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s lanes in row-major order, 1-d: uint8 for 1-byte dtypes, else int16 (16-bit
    words in the device's byte order: little-endian on every platform torch runs CUDA on)."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1:  # a size-1 dimension keeps any stride through contiguous()
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def _block_sums(x: torch.Tensor, lanes: torch.Tensor, at: tuple[slice, ...]) -> torch.Tensor:
    """Each block's ``sum a[j] * v[j]`` (float64, exact): ``lanes`` placed at ``at`` of the
    float64 buffer ``x`` of whole blocks, whose other places hold zero lanes."""
    wide = lanes.dtype == torch.int16
    x[at] = lanes ^ _FLIP if wide else lanes
    e = x.view(-1, _B) @ _weights(x.device)[0]  # exact: integers below 2^53
    if wide:
        e += _SHIFT
    return e


def _aligned_sum(lanes: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """The sum of rows that all start at one phase: padded to whole blocks, one product."""
    dev = lanes.device
    f = rows.base % _B
    nb = (f + rows.width + _B - 1) // _B
    x = torch.empty((rows.count, nb * _B), dtype=torch.float64, device=dev)
    zero = float(_FLIP) if lanes.dtype == torch.int16 else 0.0  # a zero lane, as _block_sums places it
    x[:, :f] = zero
    x[:, f + rows.width :] = zero
    e = _block_sums(x, lanes.view(rows.count, rows.width), (slice(None), slice(f, f + rows.width)))
    del x
    k = torch.arange(nb, dtype=torch.int64, device=dev)
    if rows.count > 1:
        k = (k[None, :] + (rows.starts(dev) >> logical.BLOCK_SHIFT)[:, None]).reshape(-1)
    else:
        k += rows.base >> logical.BLOCK_SHIFT
    m = multipliers(k)
    m *= e.to(torch.int64)
    return m.sum()


def _lane_sum(lanes: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """The sum of rows at different phases: each lane's term on its own."""
    dev = lanes.device
    v = lanes.view(rows.count, rows.width).to(torch.int64)
    if lanes.dtype == torch.int16:
        v &= 0xFFFF
    pos = rows.starts(dev)[:, None] + torch.arange(rows.width, dtype=torch.int64, device=dev)[None, :]
    v *= _weights(dev)[1][pos & (_B - 1)]  # below 2^47
    pos >>= logical.BLOCK_SHIFT
    m = multipliers(pos)
    del pos
    m *= v
    return m.sum()


def _box_total(t: torch.Tensor, shape: Sequence[int], offsets: Sequence[int], chunk: int) -> torch.Tensor | None:
    """The sum of one shard on its device (a 0-d int64 tensor), None for no elements."""
    s = t.element_size()
    per = 1 if s == 1 else s // 2
    if not _Rows(shape, offsets, t.shape, per).aligned:
        chunk = max(1, chunk // 8)  # a lane's terms take 8 times its bytes, several at once
    total = None
    for piece, at, size in _pieces(t, offsets, chunk):
        rows = _Rows(shape, at, size, per)
        if not rows.width or not rows.count:
            continue
        lanes = _lanes(piece)
        got = _aligned_sum(lanes, rows) if rows.aligned else _lane_sum(lanes, rows)
        total = got if total is None else total + got
    return total


def _small_sums(items: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The sums of single runs ``(lanes, first lane)`` of one lane width on one device, each
    placed at its phase in its own blocks of one buffer: one product, one prefix sum (int64)."""
    first = items[0][0]
    dev = first.device
    zeros = torch.zeros(_B, dtype=first.dtype, device=dev)
    parts: list[torch.Tensor] = []
    k0, nb = [], []
    for lanes, p0 in items:
        f, n = p0 % _B, lanes.numel()
        blocks = (f + n + _B - 1) // _B
        parts += [zeros[:f], lanes, zeros[: blocks * _B - f - n]]
        k0.append(p0 >> logical.BLOCK_SHIFT)
        nb.append(blocks)
    counts = np.asarray(nb, dtype=np.int64)
    ends = np.cumsum(counts)
    base = ends - counts
    k = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(np.asarray(k0, dtype=np.int64) - base, counts)
    x = torch.empty(int(ends[-1]) * _B, dtype=torch.float64, device=dev)
    e = _block_sums(x, torch.cat(parts), (slice(None),))
    del x
    m = multipliers(torch.from_numpy(k).to(dev))
    m *= e.to(torch.int64)
    cs = m.cumsum(0)  # wraps modulo 2^64: differences of it are the runs' sums
    at_end = cs[torch.from_numpy(ends - 1).to(dev)]
    before = torch.cat([cs.new_zeros(1), cs])[torch.from_numpy(base).to(dev)]
    return at_end - before


def _check(t: Any, shape: Sequence[int], offsets: Sequence[int]) -> int:
    """``t``'s item size, once it is known to be a plain tensor of a format dtype inside its box."""
    if not isinstance(t, torch.Tensor) or tc.is_dtensor(t) or tc.is_sharded_tensor(t):
        raise TypeError(
            f"device_partial takes a plain torch.Tensor (a shard's local tensor), not a {type(t).__name__}: "
            f"pass the local tensor with its offsets and the global shape"
        )
    name = torch_dtype_name(t.dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype {name} has no logical digest: the format stores only {', '.join(DTYPES)}")
    size = t.shape
    if not (len(shape) == len(offsets) == len(size)) or any(
        o < 0 or o + k > n for n, o, k in zip(shape, offsets, size)
    ):  # format.logical.Box's check
        raise ValueError(f"the box at {list(offsets)} of shape {list(size)} is not inside shape {list(shape)}")
    return DTYPES[name][1]


def _chunk(device: torch.device) -> int:
    return CPU_CHUNK_BYTES if device.type == "cpu" else CHUNK_BYTES


def device_partials(
    shards: Sequence[tuple[torch.Tensor, Sequence[int], Sequence[int]]], chunk_bytes: int | None = None
) -> list[int]:
    """The partial sums (``format.logical.box_sum``) of many shards ``(local tensor, global
    shape, offsets)``, each computed on its tensor's device: one synchronisation per device
    at the end, nothing copied to the host but the sums. The tensors must not change until
    this returns (it runs on each device's current stream). ``chunk_bytes``: the pieces'
    size, ``CHUNK_BYTES`` on a GPU and ``CPU_CHUNK_BYTES`` on the CPU by default."""
    out = [0] * len(shards)
    pending: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}  # (shards, their sums)
    small: dict[tuple[torch.device, bool], list[tuple[int, torch.Tensor, int]]] = {}
    for i, (t, shape_in, offsets_in) in enumerate(shards):
        shape = tuple(int(n) for n in shape_in)
        offsets = tuple(int(o) for o in offsets_in)
        s = _check(t, shape, offsets)
        if not t.numel():
            continue
        t = t.detach()
        per = 1 if s == 1 else s // 2
        rows = _Rows(shape, offsets, t.shape, per)
        if rows.count == 1 and t.numel() * s <= SMALL_BYTES:
            small.setdefault((t.device, s > 1), []).append((i, _lanes(t), rows.base))
            continue
        got = _box_total(t, shape, offsets, chunk_bytes or _chunk(t.device))
        if got is not None:
            pending.setdefault(t.device, []).append(([i], got.reshape(1)))
    for (dev, _), items in small.items():
        b0 = 0
        while b0 < len(items):  # batches of about chunk_bytes
            b1, room = b0, 0
            while b1 < len(items) and (b1 == b0 or room + items[b1][1].nbytes <= (chunk_bytes or _chunk(dev))):
                room += items[b1][1].nbytes + 2 * _B
                b1 += 1
            sums = _small_sums([(lanes, p0) for _, lanes, p0 in items[b0:b1]])
            pending.setdefault(dev, []).append(([i for i, _, _ in items[b0:b1]], sums))
            b0 = b1
    for parts in pending.values():
        values = torch.cat([sums for _, sums in parts]).tolist()  # the one synchronisation
        for i, v in zip((i for idx, _ in parts for i in idx), values):
            out[i] = int(v) & _MASK64
    return out


def device_partial(
    local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], chunk_bytes: int | None = None
) -> int:
    """The partial sum of the box at ``offsets`` of a tensor of ``global_shape`` that
    ``local`` holds (any strides), computed on ``local``'s device: ``format.logical.box_sum``
    of its row-major bytes."""
    return device_partials([(local, global_shape, offsets)], chunk_bytes)[0]


__all__ = ["CHUNK_BYTES", "CPU_CHUNK_BYTES", "SMALL_BYTES", "device_partial", "device_partials", "multipliers"]
