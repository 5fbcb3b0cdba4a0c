"""The logical digest of a tensor (docs/format.md, "Logical digests"): one value per tensor
that is the same however the tensor is sharded, laid out or split over ranks.

The tensor's global row-major bytes are read as *lanes*: 16-bit little-endian words (single
bytes for 1-byte dtypes). Lane ``p`` with value ``v`` adds ``M[p >> 6] * a[p & 63] * v``
modulo 2^64, where ``a`` holds 64 distinct odd 31-bit weights and ``M`` an odd 64-bit
multiplier per block of 64 lanes, both from splitmix64. Every lane contributes on its own, so
a rank's *partial* (the sum over the elements it holds) and the partials of any tiling add up
(mod 2^64, in any order) to the tensor's sum, whatever the boxes: rows, columns, uneven or
strided shards, flat ranges. The digest binds the dtype and the shape to that sum
(``finalize``). The weights bind every lane to its place: a piece swapped, shifted,
duplicated or zeroed changes the sum, and a change within one block of 64 lanes (one
element, two swapped ones) always does (an exact nonzero integer below 2^53 times an odd
``M``). It detects accidents, not forgery (the weights are public): the chunk digests and
encryption's MAC cover that.

A block's ``sum(a[j] * v[j])`` is below 2^53 (64 terms below 2^47), so it is computed
exactly in float64, by a matrix-vector product: the same bits on any BLAS, in any order.

Torch-free; numpy is imported on first computation (``finalize`` needs none), so the
coordinator's merge and the CLI do not load it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import numpy as np

#: The definition's name, in the manifest's ``logical`` member.
ALGORITHM = "sk-logical-1"
MASK = (1 << 64) - 1
#: Lanes per block (``p >> 6``, ``p & 63``).
BLOCK_SHIFT = 6
BLOCK = 1 << BLOCK_SHIFT
#: Lanes per numpy pass: temporaries of 2 MiB stay in cache, and the product stays below
#: the size where a BLAS starts threads.
_CHUNK = 1 << 18
#: Runs of at least this many lanes are summed whole (``_placed_sums``), shorter ones by rows.
_LONG = 1 << 12
#: Single runs of fewer lanes are best gathered many at a time (``gathered_sums``).
SHORT = 1 << 12
#: splitmix64 inputs of the weights: a[j] from 2^62 + j, M[k] from 2^63 + k.
_A_BASE = 1 << 62
_M_BASE = 1 << 63


def sm64(x: int) -> int:
    """splitmix64's output for state ``x`` (the first value of the generator seeded ``x``)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def lane_weight(j: int) -> int:
    """``a[j]``: odd, below 2^31."""
    return (sm64(_A_BASE + j) >> 33) | 1


def block_multiplier(k: int) -> int:
    """``M[k]``: odd, 64 bits."""
    return sm64(_M_BASE + k) | 1


def _sm64_np(x: np.ndarray) -> np.ndarray:
    """``sm64`` of a uint64 array (numpy's array arithmetic wraps modulo 2^64)."""
    import numpy as np

    z = x + np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


@functools.cache
def _weights() -> np.ndarray:
    """``a`` as float64 (exact: below 2^31), checked distinct."""
    import numpy as np

    a = [lane_weight(j) for j in range(BLOCK)]
    assert len(set(a)) == BLOCK
    return np.array(a, dtype=np.float64)


def _multipliers(k0: int, k1: int) -> np.ndarray:
    """``M[k0 .. k1 - 1]`` as uint64."""
    import numpy as np

    return _sm64_np(np.arange(k0, k1, dtype=np.uint64) + np.uint64(_M_BASE)) | np.uint64(1)


def lanes(data: Any, itemsize: int) -> np.ndarray:
    """The lane values of ``data`` (whole elements of ``itemsize`` bytes), no copy."""
    import numpy as np

    return np.frombuffer(data, dtype="<u1" if itemsize == 1 else "<u2")


def _blocks_sum(e: np.ndarray, k: np.ndarray) -> int:
    """``sum(M[k] * e)`` mod 2^64 for exact float64 block sums ``e`` of blocks ``k`` (int64)."""
    import numpy as np

    m = _sm64_np(k.astype(np.uint64) + np.uint64(_M_BASE)) | np.uint64(1)
    m *= e.astype(np.uint64)
    return int(m.sum())


def _sum_runs(v: np.ndarray, p: np.ndarray) -> int:
    """The sum of ``len(p)`` runs of lanes: row ``r`` of ``v`` (lane values) lies at the
    consecutive global lane positions ``p[r] ..`` (int64). Each block's part of a row is
    summed exactly in float64: rows are padded to whole blocks where they start inside one."""
    import numpy as np

    rows, width = v.shape
    a = _weights()
    phase = p & (BLOCK - 1)
    if not phase.any() and width % BLOCK == 0:  # whole blocks: one matrix-vector product
        nb = width // BLOCK
        e = v.astype(np.float64).reshape(rows * nb, BLOCK) @ a
        k = (p >> BLOCK_SHIFT)[:, None] + np.arange(nb, dtype=np.int64)
        return _blocks_sum(e, k.reshape(-1)) & MASK
    total = 0
    for f in np.unique(phase).tolist():
        sel = phase == f
        part, start = (v, p) if sel.all() else (v[sel], p[sel])
        nb = -(-(f + width) // BLOCK)
        x = np.zeros((len(part), nb * BLOCK), dtype=np.float64)
        x[:, f : f + width] = part
        x.reshape(-1, BLOCK)[...] *= a  # exact: below 2^47
        e = x.reshape(len(part), nb, BLOCK).sum(axis=2)  # exact: below 2^53
        k = ((start - f) >> BLOCK_SHIFT)[:, None] + np.arange(nb, dtype=np.int64)
        total += _blocks_sum(e.reshape(-1), k.reshape(-1))
    return total & MASK


class Box:
    """A box of a tensor (global ``shape``, the box's ``offsets`` and ``size``) as runs of
    consecutive global element indices: ``count`` runs of ``length`` elements, in the box's
    own row-major order."""

    def __init__(self, shape: Sequence[int], offsets: Sequence[int], size: Sequence[int]) -> None:
        if not (len(shape) == len(offsets) == len(size)) or any(
            o < 0 or s < 0 or o + s > n for n, o, s in zip(shape, offsets, size)
        ):
            raise ValueError(f"the box at {list(offsets)} of shape {list(size)} is not inside shape {list(shape)}")
        self.numel = math.prod(size)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        split = [d for d in range(len(shape)) if size[d] != shape[d]]
        d0 = split[-1] if split else -1  # the last dimension the box does not span
        self.length = size[d0] * strides[d0] if d0 >= 0 else self.numel
        self.count = math.prod(size[:d0]) if d0 >= 0 else 1
        self._outer = list(size[: max(d0, 0)])
        self._steps = strides[: max(d0, 0)]
        self._base = sum(o * st for o, st in zip(offsets, strides))
        self.first = self._base  # where the first run starts

    def starts(self, r0: int, r1: int) -> np.ndarray:
        """The global element index where each run ``r0 .. r1 - 1`` starts (int64)."""
        import numpy as np

        r = np.arange(r0, r1, dtype=np.int64)
        out = np.full(r1 - r0, self._base, dtype=np.int64)
        for size, step in zip(reversed(self._outer), reversed(self._steps)):
            out += (r % size) * step
            r //= size
        return out


def box_sum(data: Any, itemsize: int, shape: Sequence[int], offsets: Sequence[int], size: Sequence[int]) -> int:
    """The partial sum of a box: ``data`` holds its elements in row-major order (each of
    ``itemsize`` bytes, little-endian), at ``offsets`` of a tensor of ``shape``."""
    box = Box(shape, offsets, size)
    raw = memoryview(data).cast("B")
    if len(raw) != box.numel * itemsize:
        raise ValueError(f"a box of {box.numel} elements of {itemsize} bytes holds {len(raw)} bytes")
    return box_sums([(raw, itemsize, box)])[0]


def box_sums(boxes: Sequence[tuple[Any, int, Box]]) -> list[int]:
    """The partial sums of many boxes, ``(data, itemsize, box)`` each: runs of at least
    ``_LONG`` lanes are placed, whole, into shared block-aligned buffers (one product per
    ``_CHUNK`` lanes, however many tensors: a state of 10,000 small ones); shorter runs (a
    narrow column shard) go a box at a time, row by row in one product (``_sum_runs``)."""
    out = [0] * len(boxes)
    placed: list[tuple[int, np.ndarray, int]] = []  # (box, lanes, first lane position)
    for i, (data, itemsize, box) in enumerate(boxes):
        v = lanes(memoryview(data).cast("B"), itemsize)
        per = 1 if itemsize == 1 else itemsize // 2  # lanes per element
        width = box.length * per  # lanes per run
        if not width:
            continue
        if width >= _LONG or box.count == 1:
            firsts = [box.first] if box.count == 1 else box.starts(0, box.count).tolist()
            for r, first in enumerate(firsts):
                for a in range(0, width, _CHUNK):
                    placed.append((i, v[r * width + a : r * width + min(width, a + _CHUNK)], first * per + a))
            continue
        step = max(1, _CHUNK // width)
        for r0 in range(0, box.count, step):
            r1 = min(box.count, r0 + step)
            rows = v[r0 * width : r1 * width].reshape(r1 - r0, width)
            out[i] += _sum_runs(rows, box.starts(r0, r1) * per)
    batch: list[tuple[int, np.ndarray, int]] = []
    room = 0
    for item in [*placed, None]:
        if item is None or (batch and room + len(item[1]) + BLOCK > _CHUNK):
            for (i, _, _), total in zip(batch, _placed_sums([(v, p0) for _, v, p0 in batch])):
                out[i] += total
            batch, room = [], 0
        if item is not None:
            batch.append(item)
            room += len(item[1]) + BLOCK
    return [total & MASK for total in out]


def _placed_sums(pieces: Sequence[tuple[np.ndarray, int]]) -> list[int]:
    """The sums of runs of lanes ``(values, first position)``, each placed at its phase in
    its own blocks of one float64 buffer (zeros around it): one product gives every block's
    exact sum."""
    import numpy as np

    k0 = np.array([p0 >> BLOCK_SHIFT for _, p0 in pieces], dtype=np.int64)
    nb = np.array([((p0 & (BLOCK - 1)) + len(v) + BLOCK - 1) >> BLOCK_SHIFT for v, p0 in pieces], dtype=np.int64)
    base = np.cumsum(nb) - nb
    x = np.empty(int(nb.sum()) * BLOCK, dtype=np.float64)
    for (v, p0), b, n in zip(pieces, base.tolist(), nb.tolist()):
        at, end = b * BLOCK + (p0 & (BLOCK - 1)), (b + n) * BLOCK
        x[b * BLOCK : at] = 0
        x[at : at + len(v)] = v
        x[at + len(v) : end] = 0
    e = x.reshape(-1, BLOCK) @ _weights()  # exact: below 2^53
    k = np.arange(len(e), dtype=np.int64) + np.repeat(k0 - base, nb)
    m = _sm64_np(k.astype(np.uint64) + np.uint64(_M_BASE)) | np.uint64(1)
    m *= e.astype(np.uint64)
    return [int(t) for t in np.add.reduceat(m, base).tolist()]


def gathered_sums(
    buf: Any, starts: Sequence[int], counts: Sequence[int], firsts: Sequence[int], wide: bool
) -> list[int]:
    """The sums of many short runs that lie in one buffer (a staged file's many small
    tensors): run ``i`` is ``counts[i]`` lanes (16-bit when ``wide``, else bytes) from byte
    ``starts[i]`` of ``buf`` (even when ``wide``), at global lane positions ``firsts[i] ..``.
    Gathered into block-aligned buffers by index arrays: no Python work per run."""
    import numpy as np

    v = np.frombuffer(buf, dtype="<u2" if wide else "<u1", count=len(memoryview(buf).cast("B")) // (2 if wide else 1))
    src_all = np.asarray(starts, dtype=np.int64) >> (1 if wide else 0)
    n_all, p_all = np.asarray(counts, dtype=np.int64), np.asarray(firsts, dtype=np.int64)
    ends = np.cumsum(n_all + BLOCK)
    out: list[int] = []
    lo = 0
    while lo < len(n_all):  # batches of about _CHUNK lanes
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - n_all[lo] - BLOCK + _CHUNK, side="right")))
        n, p0, src = n_all[lo:hi], p_all[lo:hi], src_all[lo:hi]
        f = p0 & (BLOCK - 1)
        nb = (f + n + BLOCK - 1) >> BLOCK_SHIFT
        base = np.cumsum(nb) - nb
        ramp = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        x = np.zeros(int(nb.sum()) * BLOCK, dtype=np.float64)
        x[np.repeat(base * BLOCK + f, n) + ramp] = v[np.repeat(src, n) + ramp]
        e = x.reshape(-1, BLOCK) @ _weights()  # exact: below 2^53
        k = np.arange(len(e), dtype=np.int64) + np.repeat((p0 >> BLOCK_SHIFT) - base, nb)
        m = _sm64_np(k.astype(np.uint64) + np.uint64(_M_BASE)) | np.uint64(1)
        m *= e.astype(np.uint64)
        out.extend(int(t) & MASK for t in np.add.reduceat(m, base).tolist())
        lo = hi
    return out


def run_sums(runs: Sequence[tuple[Any, int, int]]) -> list[int]:
    """The partial sums of single runs ``(data, itemsize, start)``: ``data`` holds elements
    at the consecutive global indices ``start ..`` (``box_sums`` of 1-d boxes)."""
    boxes = []
    for data, itemsize, start in runs:
        n = len(memoryview(data).cast("B")) // itemsize
        boxes.append((data, itemsize, Box((start + n,), (start,), (n,))))
    return box_sums(boxes)


def combine_sums(sums: Iterable[int]) -> int:
    """Partials combined: their sum mod 2^64 (any order)."""
    return sum(sums) & MASK


def finalize(dtype: str, shape: Sequence[int], total: int) -> str:
    """The digest of a tensor of ``dtype`` and ``shape`` whose elements sum to ``total``:
    16 lowercase hex digits of XXH3-64 (seed 0) over the definition's name, the dtype, the
    shape and the sum (docs/format.md, "Logical digests")."""
    head = f"{ALGORITHM}\n{dtype}\n{','.join(str(int(n)) for n in shape)}\n".encode()
    return str(xxhash.xxh3_64_hexdigest(head + (total & MASK).to_bytes(8, "little")))


def reference_sum(data: bytes, itemsize: int, shape: Sequence[int], offsets: Sequence[int], size: Sequence[int]) -> int:
    """``box_sum`` lane by lane in plain Python, straight from the definition: for tests and
    other implementations (slow)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    per = 1 if itemsize == 1 else itemsize // 2
    width = 1 if itemsize == 1 else 2
    total = 0
    for t in range(math.prod(size)):
        idx, rest = [], t
        for s in reversed(size):
            idx.append(rest % s)
            rest //= s
        g = sum((o + i) * st for o, i, st in zip(offsets, reversed(idx), strides))
        for lane in range(per):
            at = t * itemsize + lane * width
            v = int.from_bytes(data[at : at + width], "little")
            p = g * per + lane
            total += block_multiplier(p >> BLOCK_SHIFT) * lane_weight(p & (BLOCK - 1)) * v
    return total & MASK


#: The wire's text of sums: hex without leading zeros, ``""`` for 0, comma-separated.
_SUMS = re.compile(r"(?:[0-9a-f]{1,16})?(?:,(?:[0-9a-f]{1,16})?)*")


def encode_sums(sums: Iterable[int]) -> str:
    """Sums as the wire has them: hex without leading zeros, ``""`` for 0, comma-separated."""
    return ",".join(format(s, "x") if s else "" for s in sums)


def decode_sums(text: object, count: int) -> list[int]:
    """``encode_sums``' text of ``count`` sums, or ValueError saying what is wrong."""
    if not isinstance(text, str) or not _SUMS.fullmatch(text):
        raise ValueError(f"its logical sums are not comma-separated hex numbers: {str(text)[:60]!r}")
    fields = text.split(",") if count else []
    if count == 0 and text or len(fields) != count:
        raise ValueError(f"it sends {len(fields) if text or count else 0} logical sums for {count} keys")
    return [int(f, 16) if f else 0 for f in fields]


def add_sums(texts: Sequence[object], count: int) -> str:
    """Several ranks' sums of the same ``count`` keys (described ones), added per key."""
    total = [0] * count
    for text in texts:
        total = [(a + b) & MASK for a, b in zip(total, decode_sums(text, count))]
    return encode_sums(total)


__all__ = [
    "ALGORITHM",
    "BLOCK",
    "Box",
    "block_multiplier",
    "box_sum",
    "add_sums",
    "box_sums",
    "combine_sums",
    "decode_sums",
    "encode_sums",
    "finalize",
    "gathered_sums",
    "lane_weight",
    "lanes",
    "reference_sum",
    "run_sums",
    "sm64",
]
