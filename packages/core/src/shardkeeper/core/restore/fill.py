"""Restore's fill: the planned reads (``restore/plan.py``) run and land in the target.

The bytes come through the chunk reader (``codec/read.py``: ranged reads, digests checked
block by block, decoding). Bytes that fail verification never stay in the target: a read
straight into it zeroes what it read there when the read or one of its blocks fails, and a
scratch read copies out only verified segments. Each function marks in ``wrote`` the target
keys it writes into (``set.add`` is atomic), so that a fallback knows what to rewrite.
"""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch.autograd.graph import increment_version

from shardkeeper.core.codec.read import ChunkReader
from shardkeeper.core.format.manifest import LeafRecord, itemsize
from shardkeeper.core.restore.plan import Op, RestoreStats
from shardkeeper.core.restore.reads import Read
from shardkeeper.core.state.chunks import contiguous_strides
from shardkeeper.core.state.flatten import torch_dtype_name

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer

# memmove through ctypes' PYFUNCTYPE keeps the GIL (a CFUNCTYPE call would release and retake
# it per call, and with busy threads each retake may wait a switch interval).
_MEMMOVE = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)


def _view(a: np.ndarray) -> memoryview:
    return memoryview(cast("Buffer", a))


def execute_direct(reader: ChunkReader, path: str, op: Op, stats: RestoreStats, wrote: set[str]) -> None:
    """Read the whole digest blocks of ``op`` straight into the target, verify them there
    (zeroed again if they fail); read the (at most two) partially needed blocks at its ends
    into a scratch block."""
    wrote.add(op.key)
    block = reader.block
    chunk, start, end, length = op.chunk, op.start, op.end, op.chunk.length
    target = op.dest.reshape(-1).view(torch.uint8).numpy()
    dest = _view(target)
    i_lo = start if start % block == 0 else min(length, (start // block + 1) * block)
    i_hi = end if (end % block == 0 or end == length) else (end // block) * block
    try:
        if i_lo < i_hi:
            view = dest[i_lo - start : i_hi - start]
            try:
                reader.read(path, chunk.offset + i_lo, view, [op.key])
                stats.add_read(chunk.file, len(view), direct=True)
                reader.check(path, chunk, i_lo // block, view, op.key)
            except BaseException:
                # What landed in place is unverified, or failed verification: never leave it.
                target[i_lo - start : i_hi - start] = 0
                raise
        else:
            i_lo = i_hi = end
        for idx in sorted({start // block, (end - 1) // block}):
            bs, be = idx * block, min((idx + 1) * block, length)
            lo, hi = max(bs, start), min(be, end)
            if lo >= hi or (i_lo <= lo and hi <= i_hi):
                continue  # not needed, or already read directly
            scratch = _view(np.empty(be - bs, dtype=np.uint8))
            reader.read(path, chunk.offset + bs, scratch, [op.key])
            stats.add_read(chunk.file, len(scratch))
            reader.check(path, chunk, idx, scratch, op.key)
            dest[lo - start : hi - start] = scratch[lo - bs : hi - bs]
    finally:
        increment_version(op.dest)  # written through numpy, not torch: as copy_ would


def execute_read(reader: ChunkReader, path: str, rd: Read, stats: RestoreStats, wrote: set[str]) -> None:
    """One coalesced read into a scratch buffer; verify each segment's blocks, then copy its
    overlaps out (only verified bytes reach the target)."""
    block = reader.block
    buf = np.empty(rd.end - rd.start, dtype=np.uint8)
    reader.read(path, rd.start, _view(buf), sorted({s.key for s in rd.segments}))
    stats.add_read(rd.file, len(buf))
    base = torch.from_numpy(buf)
    base_ptr = buf.ctypes.data
    moved: list[torch.Tensor] = []  # written without torch: their version counters bumped below
    try:
        for seg in rd.segments:
            off = seg.chunk.offset + seg.start - rd.start
            reader.check(path, seg.chunk, seg.start // block, _view(buf)[off : off + seg.end - seg.start], seg.key)
            for op in seg.ops:
                wrote.add(op.key)
                if op.as_bytes:  # verified above; the target's memory is exactly these bytes
                    _MEMMOVE(op.dest.data_ptr(), base_ptr + off + op.start - seg.start, op.end - op.start)
                    moved.append(op.dest)
                    continue
                isz = itemsize(torch_dtype_name(op.dtype))
                seg_bytes = base[off : off + seg.end - seg.start]
                if off % isz:  # written by a writer that does not align chunks
                    seg_bytes = seg_bytes.clone()
                flat = seg_bytes.view(op.dtype)
                first_el = (op.start - seg.start) // isz
                strides = contiguous_strides(op.chunk.shape)
                src = flat.as_strided(op.rel_shape, strides, flat.storage_offset() + first_el)
                op.dest.copy_(src)
    finally:
        if moved:  # as copy_ would: autograd then refuses a backward through tensors changed since
            increment_version(moved)


def execute_encoded(reader: ChunkReader, path: str, ops: Sequence[Op], stats: RestoreStats, wrote: set[str]) -> None:
    """An encoded chunk is read whole (a frame cannot be entered in the middle), verified
    block by block, decoded once, and every overlap copied out of the decoded bytes."""
    chunk, key = ops[0].chunk, ops[0].key
    isz = itemsize(torch_dtype_name(ops[0].dtype))
    raw = np.empty(chunk.numel * isz, dtype=np.uint8)
    reader.read_chunk(path, chunk, _view(raw), key, isz)
    stats.add_read(chunk.file, chunk.length)
    flat = torch.from_numpy(raw).view(ops[0].dtype)
    strides = contiguous_strides(chunk.shape)
    wrote.add(key)
    for op in ops:
        first = sum(lo * st for lo, st in zip(op.rel_lo, strides))
        op.dest.copy_(flat.as_strided(op.rel_shape, strides, first))


def read_bytes_leaf(
    reader: ChunkReader, paths: Sequence[str], leaf: LeafRecord, key: str, stats: RestoreStats
) -> bytes:
    """A bytes leaf, read whole and verified block by block (the same checks as tensors);
    ``paths``: each chunk's file."""
    out = bytearray(math.prod(leaf.shape))
    for c, path in zip(leaf.chunks, paths, strict=True):
        reader.read_chunk(path, c, memoryview(out)[c.offsets[0] : c.offsets[0] + c.numel], key, 1)
        stats.add_read(c.file, c.length, direct=c.encoding == "raw")
    return bytes(out)


__all__ = ["execute_direct", "execute_encoded", "execute_read", "read_bytes_leaf"]
