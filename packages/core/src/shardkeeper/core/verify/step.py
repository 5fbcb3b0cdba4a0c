"""Verify committed checkpoints end to end: files, sizes, byte ranges, digests, headers.

Reads every chunk's stored bytes in bounded windows through the chunk reader
(``codec/read.py``, as restore and export read them; memory use is one read buffer of at
most about 16 MiB at a time, whatever the checkpoint's size) and checks every digest block
the manifest records. Unlike a restore it does not stop at the first problem: each is
reported (``verify/report.py``), naming the step, the key, the file, the byte range, and
what was expected against what was found.

Needs no torch: an operator verifies a bucket from any machine (``shardkeeper verify``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Collection

from shardkeeper.core.codec.read import FRAME_HEADER_BYTES, ChunkReader, frame_problem
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord, check_tiling, itemsize
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.sizes import human_size
from shardkeeper.core.verify.headers import check_header
from shardkeeper.core.verify.report import Collector, Problem, RootVerifyReport, VerifyReport, problem_kind, rng

log = logging.getLogger(__name__)

#: Bytes read per request while checking digests (rounded down to whole digest blocks).
DEFAULT_READ_BYTES = 16 << 20
_rng = rng


def verify_step(
    storage: Storage,
    step: int,
    *,
    manifest: Manifest | None = None,
    read_bytes: int = DEFAULT_READ_BYTES,
    on_bytes: Callable[[int], object] | None = None,
    files: Collection[str] | None = None,
) -> VerifyReport:
    """Check one committed step; raises ``CheckpointNotFoundError`` if it is not committed and
    ``CorruptCheckpointError`` if its manifest does not validate (``verify_root`` turns that
    into a problem).

    Checks that every file in ``manifest.files`` exists with its ``size_bytes``; that every
    chunk's byte range lies inside its file and (unencoded) holds exactly its box's bytes;
    that the chunks of every tensor tile its shape; every digest block of every chunk; and,
    for unencoded shard files of this step, that the safetensors header agrees.

    ``on_bytes(n)`` is called as each window of ``n`` stored bytes has been checked (a progress
    bar's ``update``). The result (counts, time, problems) is logged at INFO on this module's
    logger, the problems named.

    ``files`` (root-relative paths): check only those files, their sizes, the chunks they
    hold and their headers, not the tiling (a repair's check of the copies of a step that
    a restore found damaged, before it takes another node's copy; an encrypted root read
    without its key has every file's structure checked, as without ``files``).
    ``report.files_read`` says which files had chunk bytes checked.
    """
    if isinstance(files, str):
        raise TypeError(f"verify_step(files=...) takes a collection of paths, not the string {files!r}")
    t0 = time.monotonic()
    m = manifest if manifest is not None else load_manifest(storage, step)
    report = _verify(storage, step, m, read_bytes, on_bytes, None if files is None else frozenset(files))
    report.seconds = time.monotonic() - t0
    if report.ok:
        log.info(
            "step %d: OK: %d %sfiles, %d chunks, %s checked in %.2f s",
            step,
            report.files_checked,
            "" if files is None else "of the asked ",
            report.chunks_checked,
            human_size(report.bytes_checked),
            report.seconds,
        )
    else:
        log.info(
            "step %d: DAMAGED: %d problem(s) in %.2f s (%d files, %d chunks, %s checked): %s",
            step,
            len(report.problems),
            report.seconds,
            report.files_checked,
            report.chunks_checked,
            human_size(report.bytes_checked),
            "; ".join(p.message for p in report.problems[:3]) + ("; ..." if len(report.problems) > 3 else ""),
        )
    return report


def _damage_or_read(e: CheckpointError, kind: str) -> str:
    """``kind`` (damage: a page or index file that does not validate) for a ``CorruptCheckpointError``,
    else ``read``: the storage did not answer, which proves nothing about the bytes."""
    return kind if isinstance(e, CorruptCheckpointError) else "read"


def stored_bytes(m: Manifest) -> int:
    """The stored bytes of every chunk of ``m`` (what verifying it reads): a bar's total."""
    described = getattr(m.leaves, "described", None)
    if described is not None:  # from the manifest (and its pages): no index file is read for a bar
        try:
            return sum(m.chunk_file_ends().values())
        except CheckpointError:  # a damaged page: said by the verification itself
            return sum(m.chunk_file_ends(pages=False).values())
    return sum(c.length for leaf in m.leaves.values() if leaf.kind != "object" for c in leaf.chunks)


def _recorded(m: Manifest, rel: str) -> str:
    """Who records a file's size: the manifest, or one of its pages (format.md 3.9)."""
    return "the manifest records" if rel in m.files or m.pages is None else "its page records"


def _verify(
    storage: Storage,
    step: int,
    m: Manifest,
    read_bytes: int,
    on_bytes: Callable[[int], object] | None,
    only: frozenset[str] | None,
) -> VerifyReport:
    report = VerifyReport(step=step)
    base = step_dir(step)
    out = Collector(report, storage.describe(base))
    if m.encryption is not None and not getattr(storage, "authenticate", False):
        # Encrypted, no key (codec/crypto.py): structure only; digests and tags need the key.
        from shardkeeper.core.codec.crypto_format import keyless_problems

        report.structure_only = True
        report.files_checked, found = keyless_problems(storage, m, step)
        for kind, message, where in found:
            out.add(kind, message, file=where)
        out.finish()
        return report

    sizes: dict[str, int | None] = {}
    missing_keys: dict[str, list[str]] = defaultdict(list)
    unknown: set[str] = set()  # files that could not be stat-ed: said once, not also as missing

    def actual_size(path: str) -> int | None:
        if path not in sizes:
            try:
                sizes[path] = storage.size(path)
            except CheckpointNotFoundError:
                sizes[path] = None
            except CorruptCheckpointError as e:  # the entry is not a regular file of the root: damage
                out.add("path", f"step {step}: file {storage.describe(path)} cannot be read: {e}", file=path)
                sizes[path] = None
                unknown.add(path)
            except CheckpointError as e:  # the storage did not answer: nothing is proven
                out.add("read", f"step {step}: cannot stat {storage.describe(path)}: {e}", file=path)
                sizes[path] = None
                unknown.add(path)
        return sizes[path]

    # Files, as listed (in the manifest and its pages: a damaged page is said once, and the
    # files of every other page are still checked).
    def damaged_page(rel: str, e: CheckpointError) -> None:
        out.add(_damage_or_read(e, "page"), f"step {step}: {e}", file=resolve_file(step, rel) or rel)

    try:
        listed = m.every_file(damaged_page)
    except CheckpointError as e:  # two pages that list one file; or the storage did not answer
        out.add(_damage_or_read(e, "page"), f"step {step}: {e}")
        listed = m.files
    for rel, info in sorted(listed.items()):
        path = resolve_file(step, rel)
        if path is None:
            out.add("path", f"step {step}: file entry {rel!r} is not a path inside the root", file=rel)
            continue
        if only is not None and path not in only:
            continue
        report.files_checked += 1
        size = actual_size(path)
        expected = info.get("size_bytes") if isinstance(info, dict) else None
        if path in unknown:
            continue
        if size is None:
            out.add(
                "missing-file",
                f"step {step}: file {storage.describe(path)} is missing ({_recorded(m, rel)} {expected} bytes)",
                file=path,
                expected=f"{expected} bytes",
                found="missing",
            )
        elif isinstance(expected, int) and size != expected:
            what = "truncated" if size < expected else "longer than recorded"
            out.add(
                "size",
                f"step {step}: file {storage.describe(path)} is {what}: {size} bytes, {_recorded(m, rel)} {expected}",
                file=path,
                expected=f"{expected} bytes",
                found=f"{size} bytes",
            )
        elif not isinstance(expected, int):
            out.add("manifest", f"step {step}: file entry {rel!r} has no integer size_bytes", file=path)

    # Digest parameters.
    fn: Callable[[memoryview | bytes], str] | None = None
    try:
        fn = digest_function(m.digest_algorithm)
    except ValueError as e:
        out.add("manifest", f"step {step}: {e}; digests cannot be checked")
    block = m.digest_block_bytes
    if block <= 0:
        out.add("manifest", f"step {step}: digest_block_bytes is {block}; digests cannot be checked")
        fn = None
    span = max(block, (max(read_bytes, 1) // block) * block) if block > 0 else 0
    reader = None if fn is None else ChunkReader(storage, fn, block, where=f"step {step}", remedy="")

    by_file: dict[str, list[tuple[str, LeafRecord, ChunkRecord]]] = defaultdict(list)
    # an index file or page that could not be read: its problem's kind (damage, or a read that
    # failed) and the leaves it leaves unchecked
    unread: dict[str, tuple[str, list[str]]] = {}
    described = getattr(m.leaves, "described", None)
    if described is not None:  # count the boxes of the rule asked for, to find rows beyond them
        described.track = {}

    for key, leaf in m.leaves.items():
        if leaf.kind == "object":
            continue
        try:
            isz = itemsize(leaf.dtype)
        except ValueError as e:
            out.add("dtype", f"step {step}: leaf {key}: {e}", key=key)
            continue
        try:
            chunks = leaf.chunks  # a described leaf's come from index files (format.md 3.8)
        except CheckpointError as e:
            kind, keys = unread.setdefault(str(e), (_damage_or_read(e, "index"), []))
            if not keys:  # said once; the other leaves it keeps from being checked are counted
                out.add(kind, f"step {step}: leaf {key}: {e}", key=key)
            keys.append(key)
            continue
        why = check_tiling(key, leaf.shape, chunks) if only is None else None
        if why is not None:
            out.add(
                "tiling",
                f"step {step}: leaf {key} (shape {list(leaf.shape)}): chunks do not tile the tensor: {why}",
                key=key,
            )
        for c in chunks:
            path = resolve_file(step, c.file)
            if path is None:
                out.add(
                    "path",
                    f"step {step}: leaf {key}: chunk file {c.file!r} is not a path inside the root",
                    key=key,
                    file=c.file,
                )
                continue
            if only is not None and path not in only:
                continue
            by_file[path].append((key, leaf, c))
            lo, hi = c.offset, c.offset + c.length
            where = f"leaf {key}, file {storage.describe(path)}, bytes {_rng(lo, hi)}"
            size = actual_size(path)
            if size is None:
                if path not in unknown:
                    missing_keys[path].append(key)
                continue
            if c.encoding == "raw" and c.length != c.numel * isz:
                out.add(
                    "length",
                    f"step {step}: {where}: the chunk {list(c.offsets)}+"
                    f"{list(c.shape)} of {leaf.dtype} needs {c.numel * isz} bytes, the "
                    f"manifest records {c.length}",
                    key=key,
                    file=path,
                    start=lo,
                    end=hi,
                    expected=f"{c.numel * isz} bytes",
                    found=f"{c.length} bytes",
                )
                continue
            if lo < 0 or c.length < 0 or hi > size:
                out.add(
                    "range",
                    f"step {step}: {where}: the range lies outside the file ({size} bytes; truncated?)",
                    key=key,
                    file=path,
                    start=lo,
                    end=hi,
                    expected=f"file of at least {hi} bytes",
                    found=f"{size} bytes",
                )
                continue
            if reader is None:
                continue
            nblocks = math.ceil(c.length / block)
            if len(c.digests) != nblocks:
                out.add(
                    "digests",
                    f"step {step}: {where}: {len(c.digests)} digests recorded, "
                    f"{nblocks} expected for {c.length} bytes in {block}-byte blocks",
                    key=key,
                    file=path,
                    start=lo,
                    end=hi,
                    expected=f"{nblocks} digests",
                    found=f"{len(c.digests)} digests",
                )
                continue
            report.chunks_checked += 1
            report.files_read.add(path)
            head = b""
            for w in reader.scan(path, c, span):
                if w.data is None:  # damage (an encrypted block that fails authentication), a key, or the storage
                    out.add(
                        problem_kind(w.error, "digest"),
                        f"step {step}: {where}: reading bytes {_rng(w.start, w.end)} failed: {w.error}",
                        key=key,
                        file=path,
                        start=w.start,
                        end=w.end,
                    )
                    break
                report.bytes_checked += w.end - w.start
                if on_bytes is not None:
                    on_bytes(w.end - w.start)
                if w.start == lo:
                    head = bytes(w.data[:FRAME_HEADER_BYTES])
                for bad in w.bad:
                    out.add(
                        "digest",
                        f"step {step}: leaf {key}, file {storage.describe(path)}: digest mismatch "
                        f"in file bytes {_rng(bad.start, bad.end)} (block {bad.block} of the chunk at "
                        f"{list(c.offsets)}): expected {m.digest_algorithm} {bad.expected}, found {bad.found}",
                        key=key,
                        file=path,
                        start=bad.start,
                        end=bad.end,
                        expected=bad.expected,
                        found=bad.found,
                    )

            if c.encoding != "raw" and head:
                why = frame_problem(c.encoding, head, c.numel * isz)
                if why is not None:
                    out.add(
                        "encoding",
                        f"step {step}: {where}: {why}",
                        key=key,
                        file=path,
                        start=lo,
                        end=hi,
                        expected=f"{c.numel * isz} bytes decoded",
                        found=why,
                    )

    for path, keys in sorted(missing_keys.items()):
        uniq = sorted(set(keys))
        shown = ", ".join(uniq[:5]) + (f" and {len(uniq) - 5} more" if len(uniq) > 5 else "")
        out.add(
            "missing-file",
            f"step {step}: file {storage.describe(path)} is missing; {len(keys)} chunk(s) of {shown} cannot be read",
            key=uniq[0],
            file=path,
            expected="file",
            found="missing",
        )

    # Safetensors headers of this step's own unencoded shard files.
    for path, entries in sorted(by_file.items()):
        if not path.startswith(base + "/") or actual_size(path) is None:
            continue
        if any(c.encoding != "raw" for _, _, c in entries):
            continue
        check_header(storage, step, path, actual_size(path) or 0, entries, out)

    if described is not None and only is None:
        for why in described.extra_rows({k for _, keys in unread.values() for k in keys}):
            out.add("index", f"step {step}: {why}; the checkpoint is damaged or was edited")
    for why, (kind, keys) in unread.items():
        if len(keys) > 1:
            more = ", ".join(keys[1:4]) + (", ..." if len(keys) > 4 else "")
            out.add(kind, f"step {step}: {len(keys) - 1} more leaves ({more}) not checked: {why}", key=keys[1])
    out.finish()
    return report


__all__ = [
    "DEFAULT_READ_BYTES",
    "Problem",
    "RootVerifyReport",
    "VerifyReport",
    "stored_bytes",
    "verify_step",
]
