"""Save's write, per rank: the staged items to shard files, digested as they go out.

``write_shards`` runs in the background on the staged copies (``save/stage.py``) of a
plan's items (``save/plan.py``), so the caller may mutate its tensors as soon as
``save()`` returns. Each file is written in parallel, durably; with codecs on, chunks become
references or zstd frames (docs/codecs.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

from shardkeeper.core.codec import Codecs
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import data_dir, shard_file
from shardkeeper.core.format.records import DTYPES
from shardkeeper.core.format.reports import rows_report
from shardkeeper.core.format.safetensors import (
    FRAMED_MAGIC,
    ITEM_ALIGN,
    build_header,
    chunk_name,
)
from shardkeeper.core.save.logical import submit_sums, with_logical
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.save.stage import Span
from shardkeeper.core.storage.base import Storage


@dataclass
class WriteResult:
    chunks: dict[str, Any]  # the chunks as a report's table (format/table.py rows_report)
    files: dict[str, dict[str, Any]]
    bytes_written: int
    bytes_reused: int = 0  # raw bytes of chunks stored as references (incremental)


_WRITE_BYTES = 8 << 20
_ZEROS = memoryview(bytes(ITEM_ALIGN))  # alignment padding written from elsewhere than the buffer


def _file_header(items: Sequence[WriteItem], memo: dict[Any, Any] | None, index: int) -> tuple[bytes, list[int]]:
    """A shard file's header and each item's offset in it; the same for every save of one
    cached plan, so built once (``memo``: the plan's, None when it is not cached)."""
    got = memo.get(("header", index)) if memo is not None else None
    if got is None:
        entries = [(chunk_name(i.key, i.offsets, i.shape, i.global_shape), i.dtype, i.shape, i.nbytes) for i in items]
        got = build_header(entries, {"format": "pt", "writer": "shardkeeper"}, align_items=True)
        if memo is not None:
            memo[("header", index)] = got
    return got


def _write_file(
    storage: Storage,
    step_dir: str,
    rel: str,
    items: Sequence[WriteItem],
    spans: Sequence[Span],
    algorithm: str,
    block_bytes: int,
    memo: dict[Any, Any] | None = None,
    index: int = 0,
) -> tuple[list[int], list[str], int]:
    """One shard file: the header, then each item's bytes, digested block by block in windows
    of about 8 MiB just before each window is written (the bytes are hot in cache for the
    write). Adjacent spans of one buffer go out in one write. Returns each item's offset in
    the file, its digests (comma-separated) and the file's size: per item only a string is
    made, no container (``_report_columns``)."""
    header, file_offsets = _file_header(items, memo, index)
    digest = digest_function(algorithm)
    window = max(block_bytes, (_WRITE_BYTES // block_bytes) * block_bytes)
    writer = storage.open_writer(f"{step_dir}/{rel}")
    out: list[str] = []
    pending: list[list[Any]] = []  # [buffer, start, end], adjacent spans merged
    pending_bytes = 0

    def push(buf: Any, x: int, y: int) -> None:
        """Queue ``buf[x:y]`` (merged with the last span when adjacent in the same buffer);
        write the queue once it holds about 8 MiB."""
        nonlocal pending, pending_bytes
        if pending and pending[-1][0] is buf and pending[-1][2] == x:
            pending[-1][2] = y
        else:
            pending.append([buf, x, y])
        pending_bytes += y - x
        if pending_bytes >= _WRITE_BYTES:
            for pb, pa, pe in pending:
                writer.write(pb[pa:pe])
            pending, pending_bytes = [], 0

    pos = len(header)  # where the next byte goes in the file
    try:
        writer.write(header)
        for (buf, a, b), off in zip(spans, file_offsets):
            if off > pos:  # alignment padding (zeros): in the buffer too when it mirrors the file
                if pending and pending[-1][0] is buf and pending[-1][2] + off - pos == a:
                    push(buf, a - (off - pos), a)
                else:
                    push(_ZEROS, 0, off - pos)
            if 0 < b - a <= block_bytes:  # one block (most items of a state of many small tensors)
                digests = digest(buf[a:b])
                push(buf, a, b)
            else:
                blocks = []
                for x in range(a, b, window):
                    y = min(b, x + window)
                    for z in range(x, y, block_bytes):
                        blocks.append(digest(buf[z : min(z + block_bytes, y)]))
                    push(buf, x, y)
                digests = ",".join(blocks)
            pos = off + b - a
            out.append(digests)
        for pb, pa, pe in pending:
            writer.write(pb[pa:pe])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return file_offsets, out, pos


def chunk_records(
    rel: str, items: Sequence[WriteItem], offsets: Sequence[int], digests: Sequence[str]
) -> list[tuple[str, dict[str, Any]]]:
    """``_write_file``'s chunks as records in their JSON form (format.md 3.3), with their keys:
    for writers that assemble a per-chunk manifest themselves (``dcp_import``)."""
    return [
        (
            it.key,
            {
                "file": rel,
                "offset": off,
                "length": it.nbytes,
                "offsets": list(it.offsets),
                "shape": list(it.shape),
                "digests": d,
            },
        )
        for it, off, d in zip(items, offsets, digests)
    ]


def _write_coded(
    storage: Storage,
    step_dir: str,
    rel: str,
    items: Sequence[WriteItem],
    spans: Sequence[Span],
    algorithm: str,
    block_bytes: int,
    codecs: Codecs,
) -> tuple[tuple[list[str], ChunkTable], int, int]:
    """One shard file with codecs on: each item is digested first (the digests serve both
    the reuse lookup and the record); chunks the previous checkpoint holds become references;
    the rest are written raw (a safetensors file) or, with compression, as a framed file of
    zstd frames and raw chunks. No file is created when every chunk is a reference."""
    from shardkeeper.core.codec.compression import compress_if_pays, encoding_for, precheck
    from shardkeeper.core.codec.incremental import content_id

    digest = digest_function(algorithm)
    out: list[tuple[str, dict[str, Any]]] = []
    todo: list[tuple[WriteItem, memoryview, list[str]]] = []
    reused = 0
    pieces = (
        [p for it, (buf, a, b) in zip(items, spans) for p in _slabs(it, buf[a:b])]
        if codecs.compression is not None
        else [(it, buf[a:b]) for it, (buf, a, b) in zip(items, spans)]
    )
    for it, view in pieces:
        digests = [digest(view[z : z + block_bytes]) for z in range(0, len(view), block_bytes)]
        if codecs.reuse is not None:
            ref = codecs.reuse.find(it.key, it.dtype, it.offsets, it.shape, content_id(digests, algorithm))
            if ref is not None:
                out.append((it.key, ref))
                reused += it.nbytes
                continue
        todo.append((it, view, digests))
    if not todo:
        return _record_rows(out), 0, reused
    pre: list[bytes | bool] = [False] * len(todo)
    if codecs.compression is not None:
        pre = [precheck(view, codecs.level, DTYPES[it.dtype][1]) for it, view, _ in todo]
    writer = storage.open_writer(f"{step_dir}/{rel}")
    try:
        if not any(pre):  # every chunk stays raw: a plain safetensors file
            entries = [
                (chunk_name(i.key, i.offsets, i.shape, i.global_shape), i.dtype, i.shape, i.nbytes) for i, _, _ in todo
            ]
            header, file_offsets = build_header(entries, {"format": "pt", "writer": "shardkeeper"})
            writer.write(header)
            pos = len(header)
            for (it, view, digests), off in zip(todo, file_offsets):
                writer.write(view)
                out.append((it.key, _record(rel, off, it, len(view), digests)))
                pos += len(view)
        else:
            writer.write(FRAMED_MAGIC)
            pos = len(FRAMED_MAGIC)
            for (it, view, digests), p in zip(todo, pre):
                isz = DTYPES[it.dtype][1]
                frame = p if isinstance(p, bytes) else compress_if_pays(view, codecs.level, isz) if p else None
                if frame is None:
                    writer.write(view)
                    out.append((it.key, _record(rel, pos, it, len(view), digests)))
                    pos += len(view)
                    continue
                fview = memoryview(frame)
                fdigests = [digest(fview[z : z + block_bytes]) for z in range(0, len(frame), block_bytes)]
                writer.write(frame)
                rec = _record(rel, pos, it, len(frame), fdigests)
                rec["encoding"] = encoding_for(isz)
                rec["content"] = content_id(digests, algorithm)
                out.append((it.key, rec))
                pos += len(frame)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return _record_rows(out), pos, reused


def _record_rows(recs: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[str], ChunkTable]:
    """Chunk records with their keys as table rows, the form ``_write_plain`` returns."""
    return [k for k, _ in recs], ChunkTable.from_records([r for _, r in recs], 0)


def _write_plain(
    storage: Storage,
    step_dir: str,
    rel: str,
    items: Sequence[WriteItem],
    spans: Sequence[Span],
    algorithm: str,
    block_bytes: int,
    memo: dict[Any, Any] | None,
    index: int,
) -> tuple[tuple[list[str], ChunkTable], int, int]:
    """A raw shard file, its chunks as table rows (see ``_report_columns``)."""
    offsets, digests, size = _write_file(storage, step_dir, rel, items, spans, algorithm, block_bytes, memo, index)
    return _report_columns(rel, items, offsets, digests, memo, index), size, 0


def _report_columns(
    rel: str,
    items: Sequence[WriteItem],
    offsets: list[int],
    digests: list[str],
    memo: dict[Any, Any] | None,
    index: int,
) -> tuple[list[str], ChunkTable]:
    """A file's chunks as rows of a chunk table (and each row's key), the form the report and
    the manifest use. With 10,000 small tensors a record per chunk (a dict and two lists) was
    40,000 containers per save: the collector then ran full collections in the writer
    thread, 120 ms each in a process holding 300,000 objects, every other save. The columns
    that do not change between saves of a cached plan are built once (``memo``)."""
    cols = memo.get(("columns", index)) if memo is not None else None
    if cols is None:
        cols = (
            [it.key for it in items],
            [it.nbytes for it in items],
            [len(it.shape) for it in items],
            [o for it in items for o in it.offsets],
            [n for it in items for n in it.shape],
        )
        if memo is not None:
            memo[("columns", index)] = cols
    keys, length, ndim, box_offsets, box_shape = cols
    # The memo's lists go in as they are: write_shards only concatenates these tables, which
    # copies every column.
    return keys, ChunkTable([rel], [0] * len(items), offsets, length, ndim, box_offsets, box_shape, digests, {}, 0)


def _slabs(it: WriteItem, view: memoryview) -> list[tuple[WriteItem, memoryview]]:
    """With compression, a chunk larger than SLAB_BYTES is stored as slabs of whole rows
    (dimension 0) of about that size, each its own chunk record and frame: a partial or
    resharded restore then reads (and decodes) only the slabs it overlaps, and the writer
    holds one slab's frame at a time. Deterministic, so incremental saves find the same boxes."""
    from shardkeeper.core.codec.compression import SLAB_BYTES

    if it.nbytes <= SLAB_BYTES or not it.shape or it.shape[0] < 2:
        return [(it, view)]
    row = it.nbytes // it.shape[0]
    slabs = min(it.shape[0], -(-it.nbytes // SLAB_BYTES))
    rows = -(-it.shape[0] // slabs)  # balanced: no small last slab
    out = []
    for r0 in range(0, it.shape[0], rows):
        n = min(rows, it.shape[0] - r0)
        sub = replace(it, offsets=(it.offsets[0] + r0, *it.offsets[1:]), shape=(n, *it.shape[1:]), nbytes=n * row)
        out.append((sub, view[r0 * row : (r0 + n) * row]))
    return out


def _record(rel: str, offset: int, it: WriteItem, length: int, digests: Sequence[str]) -> dict[str, Any]:
    return {
        "file": rel,
        "offset": offset,
        "length": length,
        "offsets": list(it.offsets),
        "shape": list(it.shape),
        "digests": ",".join(digests),
    }


def sync_data_dirs(storage: Storage, step_dir: str, rel: str) -> None:
    """Make the directory ``rel`` of a step (``data`` or ``data/<hex>``) durable, and each
    directory above it up to the step's: every entry a new file needs."""
    parts = rel.split("/")
    for n in range(len(parts), 0, -1):
        storage.sync_dir(f"{step_dir}/{'/'.join(parts[:n])}")
    storage.sync_dir(step_dir)


def write_durably(storage: Storage, step_dir: str, rel: str, data: bytes, directory: str) -> None:
    """Write the small file ``rel`` of a step (an index file, a page) and make its directory
    ``directory`` durable (``sync_data_dirs``)."""
    writer = storage.open_writer(f"{step_dir}/{rel}")
    try:
        writer.write(data)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    sync_data_dirs(storage, step_dir, directory)


def write_shards(
    storage: Storage,
    step_dir: str,
    groups: Sequence[Sequence[WriteItem]],
    spans: Sequence[Sequence[Span]],
    *,
    rank: int,
    attempt: str,
    algorithm: str,
    block_bytes: int,
    executor: Executor,
    codecs: Codecs | None = None,
    memo: dict[Any, Any] | None = None,
    prefixes: int = 1,
    sync: bool = True,
    logical: bool = True,
) -> WriteResult:
    """Write each staged group to its own shard file, in parallel, durably. ``memo``: the
    plan's (``SavePlan.memo``), where file headers are kept for the next save of the plan;
    ``prefixes``: the hashed subdirectories of ``data/`` (format/layout.py ``data_dir``);
    ``sync`` False: the caller makes the directory durable after writing more into it (the
    index file of described leaves), once; ``logical`` False: no logical sums (``logical_check="off"``)."""
    coded = codecs if codecs is not None and codecs.active else None
    sums = submit_sums(groups, spans, memo) if logical else None  # each leaf's logical sum, beside the writes
    futures = [
        executor.submit(
            _write_coded, storage, step_dir, shard_file(rank, attempt, i, prefixes), g, r, algorithm, block_bytes, coded
        )
        if coded is not None
        else executor.submit(
            _write_plain,
            storage,
            step_dir,
            shard_file(rank, attempt, i, prefixes),
            g,
            r,
            algorithm,
            block_bytes,
            memo,
            i,
        )
        for i, (g, r) in enumerate(zip(groups, spans))
    ]
    keys: list[str] = []
    tables: list[ChunkTable] = []
    files: dict[str, dict[str, Any]] = {}
    written = 0
    reused = 0
    errors = []
    for i, f in enumerate(futures):
        try:
            res = f.result()
        except BaseException as e:  # collect all, raise the first
            errors.append(e)
            continue
        rows, size, n_reused = res
        reused += n_reused
        if size:  # 0: every chunk is a reference, no file was written
            files[shard_file(rank, attempt, i, prefixes)] = {"size_bytes": size, "rank": rank}
            written += size
        keys.extend(rows[0])
        tables.append(rows[1])
    if errors:
        raise errors[0]
    if files and sync:
        sync_data_dirs(storage, step_dir, data_dir(rank, prefixes))
    return WriteResult(with_logical(rows_report(keys, ChunkTable.concat(tables, 0)), sums), files, written, reused)


__all__ = ["WriteResult", "chunk_records", "sync_data_dirs", "write_durably", "write_shards"]
