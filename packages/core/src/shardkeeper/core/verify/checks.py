"""The checks of one step (``verify/step.py`` runs them in this order): its files and their
sizes, each chunk's byte range and digests (and, asked, its logical sum: verify/logical.py),
the safetensors headers of its own shard files, and what index files and pages left
unchecked. Torch-free."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.codec.read import FRAME_HEADER_BYTES, ChunkReader, frame_problem
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord, check_tiling, itemsize
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify.headers import check_header
from shardkeeper.core.verify.logical import LogicalSums
from shardkeeper.core.verify.report import Collector, VerifyReport, problem_kind, rng


def _damage_or_read(e: CheckpointError, kind: str) -> str:
    """``kind`` (damage: a page or index file that does not validate) for a ``CorruptCheckpointError``,
    else ``read``: the storage did not answer, which proves nothing about the bytes."""
    return kind if isinstance(e, CorruptCheckpointError) else "read"


def _recorded(m: Manifest, rel: str) -> str:
    """Who records a file's size: the manifest, or one of its pages (format.md 3.9)."""
    return "the manifest records" if rel in m.files or m.pages is None else "its page records"


@dataclass
class StepCheck:
    """One step's verification: what each check found that the next one needs. ``only``: the
    files to check (None: all of them, and the tiling)."""

    storage: Storage
    step: int
    m: Manifest
    report: VerifyReport
    out: Collector
    only: frozenset[str] | None
    sizes: dict[str, int | None] = field(default_factory=dict)
    #: files that could not be stat-ed: said once, not also as missing
    unknown: set[str] = field(default_factory=set)
    missing_keys: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    by_file: dict[str, list[tuple[str, LeafRecord, ChunkRecord]]] = field(default_factory=lambda: defaultdict(list))
    #: an index file or page that could not be read: its problem's kind (damage, or a read
    #: that failed) and the leaves it leaves unchecked
    unread: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    #: ``verify --logical``: the sums of the leaves as their chunks are read
    logical: LogicalSums | None = None

    def actual_size(self, path: str) -> int | None:
        """The size of ``path`` in storage (asked once); None when it is missing or unknown."""
        if path not in self.sizes:
            step, out = self.step, self.out
            try:
                self.sizes[path] = self.storage.size(path)
            except CheckpointNotFoundError:
                self.sizes[path] = None
            except CorruptCheckpointError as e:  # the entry is not a regular file of the root: damage
                out.add("path", f"step {step}: file {self.storage.describe(path)} cannot be read: {e}", file=path)
                self.sizes[path] = None
                self.unknown.add(path)
            except CheckpointError as e:  # the storage did not answer: nothing is proven
                out.add("read", f"step {step}: cannot stat {self.storage.describe(path)}: {e}", file=path)
                self.sizes[path] = None
                self.unknown.add(path)
        return self.sizes[path]

    # -- files ---------------------------------------------------------------------------------
    def files(self) -> None:
        """Every file as listed (in the manifest and its pages: a damaged page is said once,
        and the files of every other page are still checked) exists with its recorded size."""
        step, out, m = self.step, self.out, self.m

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
            if self.only is not None and path not in self.only:
                continue
            self.report.files_checked += 1
            size = self.actual_size(path)
            expected = info.get("size_bytes") if isinstance(info, dict) else None
            if path not in self.unknown:
                self._file_size(rel, path, size, expected)

    def _file_size(self, rel: str, path: str, size: int | None, expected: Any) -> None:
        step, where = self.step, self.storage.describe(path)
        if size is None:
            self.out.add(
                "missing-file",
                f"step {step}: file {where} is missing ({_recorded(self.m, rel)} {expected} bytes)",
                file=path,
                expected=f"{expected} bytes",
                found="missing",
            )
        elif isinstance(expected, int) and size != expected:
            what = "truncated" if size < expected else "longer than recorded"
            self.out.add(
                "size",
                f"step {step}: file {where} is {what}: {size} bytes, {_recorded(self.m, rel)} {expected}",
                file=path,
                expected=f"{expected} bytes",
                found=f"{size} bytes",
            )
        elif not isinstance(expected, int):
            self.out.add("manifest", f"step {step}: file entry {rel!r} has no integer size_bytes", file=path)

    # -- chunks: ranges and digests ----------------------------------------------------------------
    def digest_reader(self, read_bytes: int) -> tuple[ChunkReader | None, int, int]:
        """The chunk reader that checks digests (None: they cannot be checked, said), the
        digest block and the bytes read per window."""
        step, m = self.step, self.m
        fn: Callable[[memoryview | bytes], str] | None = None
        try:
            fn = digest_function(m.digest_algorithm)
        except ValueError as e:
            self.out.add("manifest", f"step {step}: {e}; digests cannot be checked")
        block = m.digest_block_bytes
        if block <= 0:
            self.out.add("manifest", f"step {step}: digest_block_bytes is {block}; digests cannot be checked")
            fn = None
        span = max(block, (max(read_bytes, 1) // block) * block) if block > 0 else 0
        reader = None if fn is None else ChunkReader(self.storage, fn, block, where=f"step {step}", remedy="")
        return reader, block, span

    def chunks(
        self, reader: ChunkReader | None, block: int, span: int, on_bytes: Callable[[int], object] | None
    ) -> None:
        """Every tensor leaf's chunks tile it (unless ``only``), and each chunk's range and digests."""
        step, out = self.step, self.out
        for key, leaf in self.m.leaves.items():
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
                kind, keys = self.unread.setdefault(str(e), (_damage_or_read(e, "index"), []))
                if not keys:  # said once; the other leaves it keeps from being checked are counted
                    out.add(kind, f"step {step}: leaf {key}: {e}", key=key)
                keys.append(key)
                continue
            why = check_tiling(key, leaf.shape, chunks) if self.only is None else None
            if why is not None:
                out.add(
                    "tiling",
                    f"step {step}: leaf {key} (shape {list(leaf.shape)}): chunks do not tile the tensor: {why}",
                    key=key,
                )
            if self.logical is not None:
                self.logical.leaf(key, leaf, len(chunks), sound=why is None)
            for c in chunks:
                self._chunk(key, leaf, c, isz, reader, block, span, on_bytes)

    def _chunk(
        self,
        key: str,
        leaf: LeafRecord,
        c: ChunkRecord,
        isz: int,
        reader: ChunkReader | None,
        block: int,
        span: int,
        on_bytes: Callable[[int], object] | None,
    ) -> None:
        step, out = self.step, self.out
        path = resolve_file(step, c.file)
        if path is None:
            out.add(
                "path",
                f"step {step}: leaf {key}: chunk file {c.file!r} is not a path inside the root",
                key=key,
                file=c.file,
            )
            return
        if self.only is not None and path not in self.only:
            return
        self.by_file[path].append((key, leaf, c))
        lo, hi = c.offset, c.offset + c.length
        where = f"leaf {key}, file {self.storage.describe(path)}, bytes {rng(lo, hi)}"
        size = self.actual_size(path)
        if size is None:
            if path not in self.unknown:
                self.missing_keys[path].append(key)
            return
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
            return
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
            return
        if reader is None:
            return
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
            return
        self._digests(key, c, isz, path, where, reader, span, on_bytes)

    def _digests(
        self,
        key: str,
        c: ChunkRecord,
        isz: int,
        path: str,
        where: str,
        reader: ChunkReader,
        span: int,
        on_bytes: Callable[[int], object] | None,
    ) -> None:
        """Read the chunk in windows, checking every digest block, and an encoded chunk's frame header."""
        step, out, report = self.step, self.out, self.report
        lo, hi = c.offset, c.offset + c.length
        report.chunks_checked += 1
        report.files_read.add(path)
        head = b""
        acc = self.logical.chunk(key, c, isz) if self.logical is not None else None
        for w in reader.scan(path, c, span):
            if w.data is None:  # damage (an encrypted block that fails authentication), a key, or the storage
                out.add(
                    problem_kind(w.error, "digest"),
                    f"step {step}: {where}: reading bytes {rng(w.start, w.end)} failed: {w.error}",
                    key=key,
                    file=path,
                    start=w.start,
                    end=w.end,
                )
                acc = None
                break
            report.bytes_checked += w.end - w.start
            if on_bytes is not None:
                on_bytes(w.end - w.start)
            if w.start == lo:
                head = bytes(w.data[:FRAME_HEADER_BYTES])
            for bad in w.bad:
                out.add(
                    "digest",
                    f"step {step}: leaf {key}, file {self.storage.describe(path)}: digest mismatch "
                    f"in file bytes {rng(bad.start, bad.end)} (block {bad.block} of the chunk at "
                    f"{list(c.offsets)}): expected {self.m.digest_algorithm} {bad.expected}, found {bad.found}",
                    key=key,
                    file=path,
                    start=bad.start,
                    end=bad.end,
                    expected=bad.expected,
                    found=bad.found,
                )
            if w.bad:
                acc = None
            if acc is not None:
                acc.feed(w.data)
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
                acc = None
        if acc is not None:
            try:
                acc.finish(reader, path, key)
            except CorruptCheckpointError as e:  # digests pass, the frame does not decode: as written
                out.add("encoding", str(e), key=key, file=path, start=lo, end=hi)

    def missing_files(self) -> None:
        """A missing file that chunks are in, once, naming the leaves it holds."""
        for path, keys in sorted(self.missing_keys.items()):
            uniq = sorted(set(keys))
            shown = ", ".join(uniq[:5]) + (f" and {len(uniq) - 5} more" if len(uniq) > 5 else "")
            self.out.add(
                "missing-file",
                f"step {self.step}: file {self.storage.describe(path)} is missing; {len(keys)} chunk(s) of {shown} "
                f"cannot be read",
                key=uniq[0],
                file=path,
                expected="file",
                found="missing",
            )

    # -- headers ---------------------------------------------------------------------------------
    def headers(self) -> None:
        """The safetensors headers of this step's own unencoded shard files."""
        base = step_dir(self.step)
        for path, entries in sorted(self.by_file.items()):
            if not path.startswith(base + "/") or self.actual_size(path) is None:
                continue
            if any(c.encoding != "raw" for _, _, c in entries):
                continue
            check_header(self.storage, self.step, path, self.actual_size(path) or 0, entries, self.out)

    # -- index files and pages ---------------------------------------------------------------------
    def index_files(self, described: Any) -> None:
        """Rows of index files beyond the boxes the rule asks for (``described``: the leaves'
        rule, None without one), then the leaves an unread index file or page left unchecked."""
        step, out = self.step, self.out
        if described is not None and self.only is None:
            for why in described.extra_rows({k for _, keys in self.unread.values() for k in keys}):
                out.add("index", f"step {step}: {why}; the checkpoint is damaged or was edited")
        for why, (kind, keys) in self.unread.items():
            if len(keys) > 1:
                more = ", ".join(keys[1:4]) + (", ..." if len(keys) > 4 else "")
                out.add(kind, f"step {step}: {len(keys) - 1} more leaves ({more}) not checked: {why}", key=keys[1])


__all__ = ["StepCheck"]
