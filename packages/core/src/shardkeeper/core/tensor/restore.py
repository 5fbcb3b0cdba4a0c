"""Restore, per rank: plan the overlap of target pieces and saved chunks, read only those
bytes (widened to digest blocks, coalesced, in parallel), verify them, copy in place.

Bytes that fail verification never stay in the target, and what an attempt wrote into it is
recorded (:class:`TargetWrites`), so that a fallback to another step rewrites all of it.
"""

from __future__ import annotations

import ctypes
import fnmatch
import logging
import math
import operator
import posixpath
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.autograd.graph import increment_version

from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CheckpointRestoreError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
)
from shardkeeper.core.format.bounds import stored_bytes_problem
from shardkeeper.core.format.columns import without_gc
from shardkeeper.core.format.digest import block_span, digest_function
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord, itemsize
from shardkeeper.core.format.safetensors import ITEM_ALIGN
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.tensor.chunks import Piece, contiguous_strides, layout_of
from shardkeeper.core.tensor.optim_compat import check_optimizers
from shardkeeper.core.tensor.state import (
    PLAIN_TENSORS,
    FlatState,
    Leaf,
    as_torch,
    conform,
    dtype_from_name,
    torch_dtype_name,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

PER_RANK_POLICIES = ("exact", "modulo", "drop")


@dataclass
class RestoreStats:
    """What a restore read: for tests and benchmarks (bytes read vs bytes needed)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_direct: int = 0  # read straight into the target's memory, no scratch buffer
    reads: int = 0
    files: set[str] = field(default_factory=set)
    keys: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_read(self, file: str, n: int, *, direct: bool = False) -> None:
        with self._lock:
            self.bytes_read += n
            self.bytes_direct += n if direct else 0
            self.reads += 1
            self.files.add(file)


@dataclass
class TargetWrites:
    """What the attempts of one ``restore()`` wrote into its target: the target keys whose
    values an attempt may have changed (in place, or by replacing an object), and the steps
    those attempts read. A later attempt must rewrite every one of these keys
    (``restore_flat`` refuses before reading otherwise), so no value of a failed step survives
    a fallback."""

    keys: set[str] = field(default_factory=set)
    steps: list[int] = field(default_factory=list)

    def add(self, step: int, keys: Collection[str]) -> None:
        if keys:
            self.keys.update(keys)
            if step not in self.steps:
                self.steps.append(step)


@dataclass(slots=True)
class _Op:
    """Copy one box (the overlap of a target piece and a saved chunk) into the target."""

    key: str
    chunk: ChunkRecord
    dtype: torch.dtype
    dest: torch.Tensor
    rel_lo: tuple[int, ...]  # overlap box relative to the chunk
    rel_shape: tuple[int, ...]
    start: int  # minimal contiguous byte range within the chunk
    end: int
    #: the overlap is ``dest``'s whole memory, byte for byte (``_holds_its_values``), and under
    #: ``_DIRECT_MIN_BYTES``: a buffered read copies it with one memmove instead of building a
    #: source view and calling ``copy_`` (about 10 us per tensor, in threads sharing the GIL)
    as_bytes: bool = False


def _overlap_ops(
    key: str, piece: Piece, chunk: ChunkRecord, dtype: torch.dtype, isz: int, max_read: int
) -> list[_Op]:
    """The copies that move the overlap of ``piece`` and ``chunk`` (split along dimension 0
    so that no single read exceeds ``max_read`` bytes); none if they do not overlap."""
    poffs, pshape, coffs, cshape = piece.offsets, piece.shape, chunk.offsets, chunk.shape
    ndim = len(cshape)
    if ndim == 0:
        return [_Op(key, chunk, dtype, piece.local, (), (), 0, isz)]
    if poffs == coffs and pshape == cshape:  # the common case: the piece is the chunk
        nbytes = math.prod(cshape) * isz
        if nbytes <= max_read:  # ... and one read: the whole chunk into the whole piece
            return [_Op(key, chunk, dtype, piece.local, (0,) * ndim, tuple(cshape), 0, nbytes)]
        rel_lo, shape = [0] * ndim, list(cshape)
    else:
        rel_lo, shape = [], []
        for d in range(ndim):
            lo = max(poffs[d], coffs[d])
            hi = min(poffs[d] + pshape[d], coffs[d] + cshape[d])
            if lo >= hi:
                return []
            rel_lo.append(lo - coffs[d])
            shape.append(hi - lo)
    strides = contiguous_strides(cshape)
    row_bytes = strides[0] * isz
    step = max(1, max_read // max(row_bytes, 1))
    # Offsets of the overlap within the chunk beyond dimension 0 (the same for every slab).
    inner_first = sum(rel_lo[d] * strides[d] for d in range(1, ndim))
    inner_last = sum((rel_lo[d] + shape[d] - 1) * strides[d] for d in range(1, ndim))
    ops = []
    rows = shape[0]
    for r0 in range(0, rows, step):
        n = min(rows - r0, step)
        lo0 = rel_lo[0] + r0
        sub_lo = (lo0, *rel_lo[1:])
        sub_shape = (n, *shape[1:])
        first = lo0 * strides[0] + inner_first
        last = (lo0 + n - 1) * strides[0] + inner_last
        dest = piece.local
        for d in range(ndim):
            start_in_piece = coffs[d] + sub_lo[d] - poffs[d]
            if start_in_piece != 0 or sub_shape[d] != dest.shape[d]:
                dest = dest.narrow(d, start_in_piece, sub_shape[d])
        ops.append(_Op(key, chunk, dtype, dest, sub_lo, sub_shape, first * isz, (last + 1) * isz))
    return ops


def _join(step_dir: str, file: str) -> str:
    """A chunk's file as a root-relative path: a reference (``../step-N/data/...``) is
    normalized here, because object stores do not resolve ``..`` in keys."""
    path = f"{step_dir}/{file}"
    return posixpath.normpath(path) if file.startswith("../") else path


@dataclass(slots=True)
class _Segment:
    key: str
    chunk: ChunkRecord
    start: int  # block-aligned byte range within the chunk
    end: int
    ops: list[_Op]


@dataclass(slots=True)
class _Read:
    file: str
    start: int  # absolute file offsets
    end: int
    segments: list[_Segment]


def _plan_reads(ops: Iterable[_Op], block_bytes: int, max_read: int) -> list[_Read]:
    by_chunk: dict[tuple[str, int], list[_Op]] = {}
    for op in ops:
        by_chunk.setdefault((op.chunk.file, op.chunk.offset), []).append(op)
    segments: list[tuple[str, int, _Segment]] = []
    for (file, _), chunk_ops in by_chunk.items():
        chunk = chunk_ops[0].chunk
        if len(chunk_ops) == 1:
            o = chunk_ops[0]
            lo, hi = (0, o.end) if o.start == 0 and o.end == chunk.length else block_span(o.start, o.end, block_bytes, chunk.length)
            segments.append((file, chunk.offset + lo, _Segment(o.key, chunk, lo, hi, [o])))
            continue
        spans = sorted(
            (block_span(o.start, o.end, block_bytes, chunk.length), i) for i, o in enumerate(chunk_ops)
        )
        cur: _Segment | None = None
        for (lo, hi), i in spans:
            if cur is not None and lo <= cur.end and hi - cur.start <= max(max_read, cur.end - cur.start):
                cur.end = max(cur.end, hi)
                cur.ops.append(chunk_ops[i])
            else:
                cur = _Segment(chunk_ops[i].key, chunk, lo, hi, [chunk_ops[i]])
                segments.append((file, chunk.offset + lo, cur))
    segments.sort(key=operator.itemgetter(0, 1))  # file order, so adjacent ranges coalesce
    reads: list[_Read] = []
    for file, abs_start, seg in segments:
        abs_end = seg.chunk.offset + seg.end
        last = reads[-1] if reads else None
        # Chunks a save aligned (format/safetensors.py ITEM_ALIGN) leave gaps under 64 bytes
        # between them: read through those rather than split the read.
        if (last is not None and last.file == file and 0 <= abs_start - last.end < ITEM_ALIGN
                and abs_end - last.start <= max_read):
            last.end = abs_end
            last.segments.append(seg)
        else:
            reads.append(_Read(file, abs_start, abs_end, [seg]))
    return reads


#: Reads that go through a scratch buffer (small or strided overlaps) are capped at this, so
#: restore needs at most io_threads x 8 MiB beyond the target's own memory.
_BUFFERED_READ_BYTES = 8 << 20
#: Overlaps at least this large and contiguous in the target are read straight into it.
_DIRECT_MIN_BYTES = 1 << 20


def _holds_its_values(op: _Op) -> bool:
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
        and not d._is_zerotensor()
        and not d.is_inference()
        and op.end - op.start == d.numel() * d.element_size()
    )


# memmove through ctypes' PYFUNCTYPE keeps the GIL (a CFUNCTYPE call would release and retake
# it per call, and with busy threads each retake may wait a switch interval).
_MEMMOVE = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)


def _read_checked(storage: Storage, path: str, offset: int, buffer: memoryview, keys: Sequence[str], step: int) -> None:
    what = f"keys {', '.join(repr(k) for k in keys[:4])}{' ...' if len(keys) > 4 else ''}"
    try:
        storage.read_into(path, offset, buffer)
    except ChecksumMismatchError as e:  # an encrypted block failed authentication (codec/crypto.py)
        raise ChecksumMismatchError(f"step {step}, {what}: {e}", key=keys[0] if keys else "", file=path) from e
    except CorruptCheckpointError as e:  # the entry is not what the format says (a FIFO, a symlink loop...)
        raise CorruptCheckpointError(f"step {step}, {what}: {e}") from e
    except (CheckpointNotFoundError, StorageError) as e:
        where = f"step {step}: cannot read bytes [{offset}, {offset + len(buffer)}) of {storage.describe(path)} for {what}: {e}"
        if _missing_or_short(storage, path, offset + len(buffer)):
            raise CorruptCheckpointError(
                f"{where}. The file is missing or shorter than the manifest says: the checkpoint "
                f"is damaged. Restore an earlier step (restore() without step= falls back by "
                f"itself) and run `shardkeeper verify {storage.url}`"
            ) from e
        raise StorageError(f"{where}. The file is there, whole in size: the storage failed (after its retries)") from e


def _check_block(
    storage: Storage, path: str, chunk: ChunkRecord, idx: int, data: memoryview, digest: Callable[[Any], str],
    block: int, key: str, step: int,
) -> None:
    got = digest(data)
    want = chunk.digests[idx] if idx < len(chunk.digests) else "<none>"
    if got != want:
        raise ChecksumMismatchError(
            f"checksum mismatch in {storage.describe(path)} at bytes "
            f"[{chunk.offset + idx * block}, {chunk.offset + min((idx + 1) * block, chunk.length)}) "
            f"of key {key!r}, step {step}: expected {want}, read {got}. The stored bytes are "
            f"damaged: restore an earlier step (restore() without step= falls back by itself) "
            f"and run `shardkeeper verify {storage.url}`",
            key=key,
            file=path,
        )


def _execute_direct(
    storage: Storage, step_dir: str, op: _Op, digest: Callable[[Any], str], block: int,
    stats: RestoreStats, step: int, wrote: set[str],
) -> None:
    """Read the whole digest blocks of ``op`` straight into the target, verify them there
    (zeroed again if they fail); read the (at most two) partially needed blocks at its ends
    into a scratch block."""
    wrote.add(op.key)
    chunk, start, end, length = op.chunk, op.start, op.end, op.chunk.length
    path = _join(step_dir, chunk.file)
    target = op.dest.reshape(-1).view(torch.uint8).numpy()
    dest = memoryview(cast("Buffer", target))
    i_lo = start if start % block == 0 else min(length, (start // block + 1) * block)
    i_hi = end if (end % block == 0 or end == length) else (end // block) * block
    try:
        if i_lo < i_hi:
            view = dest[i_lo - start : i_hi - start]
            try:
                _read_checked(storage, path, chunk.offset + i_lo, view, [op.key], step)
                stats.add_read(chunk.file, len(view), direct=True)
                for b in range(i_lo, i_hi, block):
                    _check_block(storage, path, chunk, b // block, view[b - i_lo : min(b + block, i_hi) - i_lo],
                                 digest, block, op.key, step)
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
            scratch = memoryview(cast("Buffer", np.empty(be - bs, dtype=np.uint8)))
            _read_checked(storage, path, chunk.offset + bs, scratch, [op.key], step)
            stats.add_read(chunk.file, len(scratch))
            _check_block(storage, path, chunk, idx, scratch, digest, block, op.key, step)
            dest[lo - start : hi - start] = scratch[lo - bs : hi - bs]
    finally:
        increment_version(op.dest)  # written through numpy, not torch: as copy_ would


def _missing_or_short(storage: Storage, path: str, end: int) -> bool:
    """After a failed read: is the file gone or shorter than the manifest says (damage), or
    did the storage fail (possibly transient)?"""
    try:
        return storage.size(path) < end
    except CheckpointNotFoundError:
        return True
    except StorageError:
        return False


def _execute_read(
    storage: Storage,
    step_dir: str,
    rd: _Read,
    digest: Callable[[Any], str],
    block_bytes: int,
    stats: RestoreStats,
    step: int,
    wrote: set[str],
) -> None:
    """One coalesced read into a scratch buffer; verify each segment's blocks, then copy its
    overlaps out (only verified bytes reach the target)."""
    path = _join(step_dir, rd.file)
    buf = np.empty(rd.end - rd.start, dtype=np.uint8)
    _read_checked(storage, path, rd.start, memoryview(cast("Buffer", buf)), sorted({s.key for s in rd.segments}), step)
    stats.add_read(rd.file, len(buf))
    base = torch.from_numpy(buf)
    base_ptr = buf.ctypes.data
    moved: list[torch.Tensor] = []  # written without torch: their version counters bumped below
    try:
        for seg in rd.segments:
            off = seg.chunk.offset + seg.start - rd.start
            view = memoryview(cast("Buffer", buf))[off : off + seg.end - seg.start]
            first_block = seg.start // block_bytes
            for i in range(0, len(view), block_bytes):
                _check_block(storage, path, seg.chunk, first_block + i // block_bytes, view[i : i + block_bytes],
                             digest, block_bytes, seg.key, step)
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


def _size_or_none(storage: Storage, path: str) -> int | None:
    """The file's size, None if it is missing (a storage failure is raised: maybe transient)."""
    try:
        return storage.size(path)
    except CheckpointNotFoundError:
        return None


def _check_file_ends(storage: Storage, step_dir: str, step: int, ends: dict[str, tuple[int, str]]) -> None:
    """Before any read: every file exists and reaches the end a chunk of ``key`` claims in it
    (one size query a file), so a hostile or damaged manifest fails before data is read."""
    for file, (end, key) in ends.items():
        path = _join(step_dir, file)
        if _missing_or_short(storage, path, end):
            raise CorruptCheckpointError(
                f"step {step}: {storage.describe(path)} is missing or shorter than the {end} bytes "
                f"the manifest records for key {key!r}; the checkpoint is damaged: restore an "
                f"earlier step and run `shardkeeper verify {storage.url}`"
            )


def _bytes_of(
    storage: Storage, step_dir: str, leaf: LeafRecord, manifest: Manifest, key: str, stats: RestoreStats
) -> bytes:
    """A bytes leaf, read whole and verified block by block (the same checks as tensors)."""
    digest = digest_function(manifest.digest_algorithm)
    block = manifest.digest_block_bytes
    # No target sizes a bytes leaf, the manifest does: before allocating it, check that the
    # files hold its chunks (validation bounded what each chunk's stored bytes decode to).
    why = stored_bytes_problem(leaf.chunks, lambda file: _size_or_none(storage, _join(step_dir, file)))
    if why is not None:
        raise CorruptCheckpointError(
            f"step {manifest.step}: bytes leaf {key!r} ({math.prod(leaf.shape)} bytes) cannot be read from "
            f"{storage.describe(step_dir)}: {why}; the checkpoint is damaged: restore an earlier step and run "
            f"`shardkeeper verify {storage.url}`"
        )
    out = bytearray(math.prod(leaf.shape))
    for c in leaf.chunks:
        path = _join(step_dir, c.file)
        dest = memoryview(out)[c.offsets[0] : c.offsets[0] + c.numel]
        view = dest if c.encoding == "raw" else memoryview(bytearray(c.length))
        _read_checked(storage, path, c.offset, view, [key], manifest.step)
        stats.add_read(c.file, c.length, direct=c.encoding == "raw")
        for i in range(0, c.length, block):
            _check_block(storage, path, c, i // block, view[i : i + block], digest, block, key, manifest.step)
        if c.encoding != "raw":
            _decode(storage, path, c, view, dest, key, manifest.step)
    return bytes(out)


def _decode(
    storage: Storage, path: str, chunk: ChunkRecord, stored: memoryview, out: memoryview, key: str, step: int,
    isz: int = 1,
) -> None:
    """Decode a verified encoded chunk's stored bytes into ``out`` (its raw bytes)."""
    from shardkeeper.core.codec.compression import ENCODING, SHUFFLED, decompress_into

    where = (
        f"step {step}: key {key!r}, {storage.describe(path)} bytes "
        f"[{chunk.offset}, {chunk.offset + chunk.length})"
    )
    if chunk.encoding not in (ENCODING, SHUFFLED):  # only a manifest that was not validated
        raise CorruptCheckpointError(f"{where}: unknown encoding {chunk.encoding!r}")
    decompress_into(stored, out, where, isz if chunk.encoding == SHUFFLED else 1)


def _execute_encoded(
    storage: Storage, step_dir: str, ops: Sequence[_Op], digest: Callable[[Any], str], block: int,
    stats: RestoreStats, step: int, wrote: set[str],
) -> None:
    """An encoded chunk is read whole (a frame cannot be entered in the middle), verified
    block by block, decoded once, and every overlap copied out of the decoded bytes."""
    chunk, key = ops[0].chunk, ops[0].key
    path = _join(step_dir, chunk.file)
    stored = np.empty(chunk.length, dtype=np.uint8)
    view = memoryview(cast("Buffer", stored))
    _read_checked(storage, path, chunk.offset, view, [key], step)
    stats.add_read(chunk.file, chunk.length)
    for i in range(0, chunk.length, block):
        _check_block(storage, path, chunk, i // block, view[i : i + block], digest, block, key, step)
    isz = itemsize(torch_dtype_name(ops[0].dtype))
    raw = np.empty(chunk.numel * isz, dtype=np.uint8)
    _decode(storage, path, chunk, view, memoryview(cast("Buffer", raw)), key, step, isz)
    del stored, view
    flat = torch.from_numpy(raw).view(ops[0].dtype)
    strides = contiguous_strides(chunk.shape)
    wrote.add(key)
    for op in ops:
        first = sum(lo * st for lo, st in zip(op.rel_lo, strides))
        op.dest.copy_(flat.as_strided(op.rel_shape, strides, first))


def _matches(key: str, patterns: Sequence[str] | None) -> bool:
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(key, p) or key.startswith(p.rstrip("/") + "/") or key == p for p in patterns)


def _listing(items: Sequence[str], limit: int = 20) -> str:
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def _guarded(fn: Callable[..., None], failed: threading.Event) -> Callable[..., None]:
    """``fn`` (a read into the target) under no_grad (it is per thread: the copies into leaf
    tensors that require grad run in the pool); it does nothing once another read of the
    same attempt failed, and a failure of its own sets ``failed``."""

    def run(*args: Any) -> None:
        if failed.is_set():
            return  # the attempt has failed: write nothing more into the target
        try:
            with torch.no_grad():
                fn(*args)
        except BaseException:
            failed.set()
            raise

    return run


def _prefixes(keys: Sequence[str]) -> set[str]:
    """Every ``/``-prefix of every key (``a/b/c`` -> ``a``, ``a/b``, ``a/b/c``): one set
    answers "was anything under this prefix restored" for every finalizer."""
    out: set[str] = set()
    for k in keys:
        parts = k.split("/")
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return out


def _source_key(leaf: Leaf, key: str, rank: int, saved_world: int, world: int, policy: str) -> str | None:
    """The saved key a per-rank target leaf reads from, by policy; None means skip it."""
    if leaf.per_rank is None:
        return key
    prefix = f"{leaf.per_rank}/{rank}"
    rest = key[len(prefix) :]
    if saved_world == world:
        return key
    if policy == "modulo":
        return f"{leaf.per_rank}/{rank % saved_world}{rest}"
    if policy == "drop":
        return None
    raise StateMismatchError(
        f"per-rank state {leaf.per_rank!r} was saved at world size {saved_world}, restoring at "
        f"{world} (rank {rank}); choose a policy: per_rank='modulo' (rank r reads rank "
        f"r % {saved_world}) or per_rank='drop' (start it fresh)"
    )


@without_gc  # planning makes a few objects per chunk: no full collections meanwhile
def restore_flat(
    storage: Storage,
    step_dir: str,
    manifest: Manifest,
    flat: FlatState,
    *,
    rank: int,
    world_size: int,
    only: Sequence[str] | None,
    strict: bool,
    optional: Sequence[str] | None = None,
    per_rank: str,
    cast: bool,
    executor: Executor,
    max_read_bytes: int,
    writes: TargetWrites | None = None,
) -> RestoreStats:
    """Fill ``flat``'s leaves from ``manifest`` (in place), then run its finalizers.

    A finalizer (``load_state_dict`` of a stateful object) runs only when some leaf under its
    key was restored, so ``only=`` never hands an object its own current values back. Target
    keys matching ``optional`` that the checkpoint lacks are skipped without a word.

    Tensors are filled by the reads; objects and bytes are set, and finalizers run, only after
    every read succeeded. ``writes`` collects the target keys this attempt wrote; the keys an
    earlier attempt wrote (already in it) must all be restored by this one, or it raises
    before reading anything.
    """
    writes = TargetWrites() if writes is None else writes
    stats = RestoreStats()
    where = f"{storage.describe(step_dir)} (step {manifest.step}, rank {rank})"
    if flat.optimizers:
        check_optimizers(flat.optimizers, manifest, lambda k: _matches(k, only), where)
    missing: list[str] = []
    dropped: list[str] = []
    ops: list[_Op] = []
    deferred: list[tuple[str, Callable[[], None]]] = []
    restored: list[str] = []
    mismatched: list[str] = []
    wrong_dtype: list[str] = []
    on_meta: list[str] = []
    bytes_leaves: list[tuple[str, Leaf, LeafRecord]] = []
    # A table-form manifest makes only the chunk records that overlap this rank's pieces.
    table = manifest.leaves if isinstance(manifest.leaves, TableLeaves) else None
    for key, leaf in flat.leaves.items():
        if not _matches(key, only):
            continue
        src_key = _source_key(leaf, key, rank, manifest.world_size, world_size, per_rank)
        if src_key is None:
            dropped.append(key)
            continue
        rec = table.head(src_key) if table is not None else manifest.leaves.get(src_key)
        if rec is None:
            if not (optional and _matches(key, optional)):
                missing.append(src_key)
            continue
        stats.keys += 1
        restored.append(key)
        if leaf.kind == "object" or rec.kind == "object":
            if leaf.kind != rec.kind:
                raise StateMismatchError(
                    f"key {key!r} in {where} is a {rec.kind} leaf in the checkpoint but a "
                    f"{leaf.kind} in the target state; the state's structure changed"
                )
            assert leaf.set is not None
            setter, value, current = leaf.set, rec.value, leaf.value

            def fill(
                s: Callable[[Any], None] = setter, v: Any = value, c: Any = current
            ) -> None:
                s(conform(v, c))

            deferred.append((key, fill))
            continue
        if rec.kind == "bytes":
            if leaf.kind != "bytes":
                raise StateMismatchError(
                    f"key {key!r} in {where} is a bytes leaf in the checkpoint but a {leaf.kind} "
                    f"in the target state; the state's structure changed"
                )
            bytes_leaves.append((key, leaf, manifest.leaves[src_key]))  # read after every check, with the tensors
            continue
        target = as_torch(leaf.value)
        layout = layout_of(target, world_size, rank)
        if any(p.local.is_meta for p in layout.pieces):
            on_meta.append(key)  # no memory: a copy into it does nothing
            continue
        if tuple(layout.global_shape) != tuple(rec.shape):
            mismatched.append(
                f"{key!r}: checkpoint shape {list(rec.shape)}, target {list(layout.global_shape)}"
            )
            continue
        saved_dtype = dtype_from_name(rec.dtype)
        if saved_dtype != layout.dtype and not cast:
            wrong_dtype.append(f"{key!r}: checkpoint {rec.dtype}, target {torch_dtype_name(layout.dtype)}")
            continue
        isz = itemsize(rec.dtype)
        for piece in layout.pieces:
            stats.bytes_needed += piece.numel * isz
            chunks = rec.chunks if table is None else table.overlapping(src_key, piece.offsets, piece.shape)
            for chunk in chunks:
                ops.extend(_overlap_ops(key, piece, chunk, saved_dtype, isz, max_read_bytes))
    if on_meta:
        raise StateMismatchError(
            f"{len(on_meta)} tensor(s) of the target state are on the meta device (a shape without "
            f"memory: restoring into them would do nothing), so nothing of {where} was read: "
            f"{_listing(on_meta, 8)}. Give the model memory first, model.to_empty(device=...) "
            f"(build the optimizer after that), or build it on a real device, then restore"
        )
    if mismatched:
        raise StateMismatchError(
            f"{len(mismatched)} key(s) in {where} have another shape than the target state: "
            f"{_listing(mismatched)}; build the model with the saved configuration, or exclude "
            f"the keys with only=[...]"
        )
    if wrong_dtype:
        raise StateMismatchError(
            f"{len(wrong_dtype)} key(s) in {where} have another dtype than the target state: "
            f"{_listing(wrong_dtype)}; pass cast_dtypes=True to cast on restore"
        )
    if only and not stats.keys and not missing:
        raise StateMismatchError(
            f"only={list(only)} matches no key of the target state in {where}; list the "
            f"checkpoint's keys with `shardkeeper inspect {storage.url} {manifest.step}`"
        )
    if missing:
        listed = f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        if strict:
            raise StateMismatchError(
                f"{len(missing)} key(s) of the target state are not in {where}: {listed}; "
                f"restore a subset with only=[...] or pass strict=False to skip them"
            )
        warnings.warn(
            f"strict=False: {len(missing)} key(s) of the target state are not in {where} and "
            f"keep their current values: {listed}",
            stacklevel=3,
        )
    if dropped:
        log.warning(
            "rank %d: per-rank state not restored (saved at world size %d, now %d, per_rank='drop'): %s",
            rank, manifest.world_size, world_size, ", ".join(dropped[:8]),
        )
    digest = digest_function(manifest.digest_algorithm)
    block = manifest.digest_block_bytes
    direct: list[_Op] = []  # read straight into the target
    buffered: list[_Op] = []  # read into a scratch buffer, then copied (memmove when as_bytes)
    encoded: dict[tuple[str, int], list[_Op]] = {}
    for op in ops:
        if op.chunk.encoding != "raw":
            encoded.setdefault((op.chunk.file, op.chunk.offset), []).append(op)
        elif not _holds_its_values(op):
            buffered.append(op)  # copy_ into a strided, cast, negated (...) target
        elif op.end - op.start >= _DIRECT_MIN_BYTES:
            direct.append(op)
        else:
            op.as_bytes = True
            buffered.append(op)
    # Scratch reads stay within ~5% of what this rank restores (at least 256 KiB each, at
    # most 8 MiB), so restore memory stays close to the target's own size.
    buffered_cap = int(min(_BUFFERED_READ_BYTES, max(256 << 10, stats.bytes_needed // 80)))
    reads = _plan_reads(buffered, block, min(max_read_bytes, buffered_cap))
    ends: dict[str, tuple[int, str]] = {}
    for op in ops:
        end = op.chunk.offset + op.chunk.length
        if end > ends.get(op.chunk.file, (-1, ""))[0]:
            ends[op.chunk.file] = (end, op.key)
    _check_rewrites(writes, restored, where, manifest.step)
    _check_file_ends(storage, step_dir, manifest.step, ends)
    # Bytes leaves are read first but set only with the objects, once every read succeeded.
    bytes_values = [_bytes_of(storage, step_dir, rec, manifest, key, stats) for key, _, rec in bytes_leaves]
    wrote: set[str] = set()
    failed = threading.Event()
    try:
        with torch.no_grad():
            # Large reads first: they dominate the time, small ones fill in behind them.
            # Each marks in ``wrote`` the keys it writes into (set.add is atomic).
            futures = [
                executor.submit(_guarded(_execute_direct, failed), storage, step_dir, op, digest, block, stats,
                                manifest.step, wrote)
                for op in sorted(direct, key=lambda o: o.start - o.end)
            ]
            futures += [
                executor.submit(_guarded(_execute_read, failed), storage, step_dir, rd, digest, block, stats,
                                manifest.step, wrote)
                for rd in reads
            ]
            futures += [
                executor.submit(_guarded(_execute_encoded, failed), storage, step_dir, eops, digest, block, stats,
                                manifest.step, wrote)
                for eops in encoded.values()
            ]
            errors = []
            for f in futures:  # every one, even after a failure: none may still write afterwards
                try:
                    f.result()
                except BaseException as e:
                    errors.append(e)
            if errors:
                raise errors[0]
            for key, fn in deferred:
                wrote.add(key)
                fn()
            for (key, leaf, _), value in zip(bytes_leaves, bytes_values):
                assert leaf.set is not None
                wrote.add(key)
                leaf.set(value)
            touched = _prefixes(restored)
            for prefix, fin in flat.finalizers:
                if prefix in touched:
                    fin()
    finally:
        writes.add(manifest.step, wrote)
    return stats


def _check_rewrites(writes: TargetWrites, restored: Sequence[str], where: str, step: int) -> None:
    """Before a fallback reads anything: it must rewrite every key an earlier attempt wrote,
    or those would keep a failed step's values next to this step's."""
    if not writes.keys:
        return
    lacking = sorted(writes.keys.difference(restored))
    if lacking:
        steps = ", ".join(map(str, writes.steps))
        raise CheckpointRestoreError(
            f"{len(lacking)} key(s) of the target were written while restoring step(s) {steps}, "
            f"which failed, and {where} does not hold them, so they would keep the values of "
            f"step(s) {steps}: {_listing(lacking, 8)}; nothing of step {step} was read. Rebuild those "
            f"parts of the state and restore step {step} explicitly (restore(state, step={step}, "
            f"...)), or repair or delete step {steps}"
        )
