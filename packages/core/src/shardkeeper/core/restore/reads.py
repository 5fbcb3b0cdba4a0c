"""How a restore plan's ops are read (``restore/fill.py`` runs them): straight into the target,
coalesced scratch reads widened to digest blocks, or, for an encoded chunk, the whole chunk once."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardkeeper.core.format.digest import block_span
from shardkeeper.core.format.manifest import ChunkRecord
from shardkeeper.core.format.safetensors import ITEM_ALIGN
from shardkeeper.core.restore.plan import Op
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.flatten import PLAIN_TENSORS

#: Reads that go through a scratch buffer (small or strided overlaps) are capped at this, so
#: restore needs at most io_threads x 8 MiB beyond the target's own memory.
_BUFFERED_READ_BYTES = 8 << 20
#: Overlaps at least this large and contiguous in the target are read straight into it.
_DIRECT_MIN_BYTES = 1 << 20
#: ... in reads of at most this (split on digest blocks) where the ranks may share reads, so
#: that a replica-deduplicated restore (``restore/share.py``), which holds every exchanged byte
#: a read needs until it runs, holds a few of these at a time, not a whole tensor. Elsewhere
#: at most ``max_read_bytes``: reads into the target's own memory need no bound of their own,
#: and smaller ones cost (a restore of 256 MiB from the page cache took 25 % longer in reads
#: of 8 MiB than of 64 MiB on a 2-core machine).
_SHARED_DIRECT_MAX_BYTES = 8 << 20


@dataclass(slots=True)
class Segment:
    """The ops of one chunk that one read serves, and the block-aligned range they need."""

    key: str
    chunk: ChunkRecord
    start: int  # block-aligned byte range within the chunk
    end: int
    ops: list[Op]


@dataclass(slots=True)
class Read:
    """One ranged read of a file into a scratch buffer."""

    file: str
    start: int  # absolute file offsets
    end: int
    segments: list[Segment]


def plan_reads(ops: Iterable[Op], block_bytes: int, max_read: int) -> list[Read]:
    """Widen each op to digest blocks, merge the overlapping ranges of one chunk, and
    coalesce adjacent ranges of one file into reads of at most ``max_read`` bytes."""
    by_chunk: dict[tuple[str, int], list[Op]] = {}
    for op in ops:
        c = op.chunk
        same = by_chunk.get((c.file, c.offset))
        if same is None:
            by_chunk[(c.file, c.offset)] = [op]
        else:
            same.append(op)
    segments: list[tuple[str, int, int, Segment]] = []  # file, absolute start and end, segment
    add = segments.append
    for (file, at), chunk_ops in by_chunk.items():
        chunk = chunk_ops[0].chunk
        if len(chunk_ops) == 1:  # the common case: one op of the chunk, often all of it
            o = chunk_ops[0]
            whole = o.start == 0 and o.end == chunk.length
            lo, hi = (0, o.end) if whole else block_span(o.start, o.end, block_bytes, chunk.length)
            add((file, at + lo, at + hi, Segment(o.key, chunk, lo, hi, chunk_ops)))
            continue
        spans = sorted((block_span(o.start, o.end, block_bytes, chunk.length), i) for i, o in enumerate(chunk_ops))
        cur: Segment | None = None
        for (lo, hi), i in spans:
            if cur is not None and lo <= cur.end and hi - cur.start <= max(max_read, cur.end - cur.start):
                cur.end = max(cur.end, hi)
                cur.ops.append(chunk_ops[i])
            else:
                if cur is not None:
                    add((file, at + cur.start, at + cur.end, cur))
                cur = Segment(chunk_ops[i].key, chunk, lo, hi, [chunk_ops[i]])
        if cur is not None:
            add((file, at + cur.start, at + cur.end, cur))
    segments.sort(key=operator.itemgetter(0, 1))  # file order, so adjacent ranges coalesce
    reads: list[Read] = []
    last: Read | None = None
    last_file, last_start, last_end = "", 0, 0
    for file, abs_start, abs_end, seg in segments:
        # Chunks a save aligned (format/safetensors.py ITEM_ALIGN) leave gaps under 64 bytes
        # between them: read through those rather than split the read.
        if (
            last is not None
            and last_file == file
            and 0 <= abs_start - last_end < ITEM_ALIGN
            and abs_end - last_start <= max_read
        ):
            last.end = last_end = abs_end
            last.segments.append(seg)
        else:
            last = Read(file, abs_start, abs_end, [seg])
            reads.append(last)
            last_file, last_start, last_end = file, abs_start, abs_end
    return reads


def _holds_its_values(op: Op) -> bool:
    """Is ``op.dest``'s memory exactly its values, of the saved dtype, so that bytes can be
    written into it without torch (a read straight into it, a memmove)? A plain CPU tensor,
    contiguous and strided, not a lazily negated view, not a zero tensor (no memory), not an
    inference tensor (``copy_`` refuses to write those outside inference mode: so do we), and
    ``op`` covers all of it."""
    d = op.dest
    return (
        op.chunk.encoding == "raw"
        and type(d) in PLAIN_TENSORS
        and d.device.type == "cpu"
        and d.dtype == op.dtype
        and d.layout == torch.strided
        and d.is_contiguous()
        and not d.is_neg()
        and not tc.is_zero_tensor(d)
        and not d.is_inference()
        and op.end - op.start == d.numel() * d.element_size()
    )


def _split(op: Op, block: int, most: int) -> list[Op]:
    """A direct ``op`` as reads of at most ``most`` bytes (at least one digest block),
    cut at multiples of the block and the item size within the chunk: each part is a
    contiguous slice of ``op.dest`` and verifies whole blocks (its box, ``rel_lo`` and
    ``rel_shape``, which direct reads do not use, stays the op's)."""
    isz = op.dest.element_size()
    unit = math.lcm(block, isz)
    step = max(unit, most // unit * unit)
    if op.end - op.start <= step:
        return [op]
    cuts = [op.start, *range((op.start // step + 1) * step, op.end, step), op.end]
    with torch.no_grad():  # views of a parameter, written through numpy: no autograd graph
        flat = op.dest.reshape(-1)
        return [
            dataclasses.replace(op, dest=flat[(lo - op.start) // isz : (hi - op.start) // isz], start=lo, end=hi)
            for lo, hi in zip(cuts, cuts[1:])
        ]


def schedule(
    ops: Sequence[Op], block: int, bytes_needed: int, max_read_bytes: int, *, shared: bool = False
) -> tuple[list[Op], list[Read], list[list[Op]]]:
    """The ops as the fill runs them: read straight into the target (in parts of at most
    ``max_read_bytes``, or ``_SHARED_DIRECT_MAX_BYTES`` where the ranks may share reads:
    ``shared``); coalesced scratch reads
    (copied out by memmove where ``as_bytes``, else ``copy_`` into a strided, cast, negated
    (...) target); and, per encoded chunk, its ops."""
    direct: list[Op] = []
    buffered: list[Op] = []
    encoded: dict[tuple[str, int], list[Op]] = {}
    for op in ops:
        if op.chunk.encoding != "raw":
            encoded.setdefault((op.chunk.file, op.chunk.offset), []).append(op)
        elif not _holds_its_values(op):
            buffered.append(op)
        elif op.end - op.start >= _DIRECT_MIN_BYTES:
            direct += _split(op, block, min(max_read_bytes, _SHARED_DIRECT_MAX_BYTES if shared else max_read_bytes))
        else:
            op.as_bytes = True
            buffered.append(op)
    # Scratch reads stay within ~5% of what this rank restores (at least 256 KiB each, at
    # most 8 MiB), so restore memory stays close to the target's own size.
    buffered_cap = int(min(_BUFFERED_READ_BYTES, max(256 << 10, bytes_needed // 80)))
    return direct, plan_reads(buffered, block, min(max_read_bytes, buffered_cap)), list(encoded.values())


__all__ = ["Read", "Segment", "plan_reads", "schedule"]
