"""Rank pages (docs/format.md 3.9): the per-rank records of a described
save (each rank's files, index file and chunk-file ends) in one file per group of ranks,
so that the manifest holds O(groups) entries instead of O(ranks).

At 16,384 ranks, listing every rank's files, index entry and chunk files in the manifest
makes it grow with the world (4.4 MB, parsed by every restoring rank). A save at a world
larger than its group size instead has each group leader write its group's records into a
*page*, checked by size and digest from the manifest: a restoring rank reads the page of
each rank whose chunks it needs (one, under a same-world restore), and only ``verify``,
``gc`` and friends read them all.

Layering: a leaf of the format package beside format/described.py, which reads its index
entries through it. Torch-free.
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UntrustedJSONError
from shardkeeper.core.format.bounds import PAGE_BYTES_PER_RANK, max_page_ranks
from shardkeeper.core.format.records import NOT_A_DATA_FILE, safe_chunk_path, safe_relative_path
from shardkeeper.core.format.untrusted import loads_untrusted

PAGE_SCHEMA = 1
#: A page larger than this is refused before it is read.
MAX_PAGE_BYTES = 1 << 28
#: The columns of the manifest's ``described.pages``, one entry per page.
PAGE_COLUMNS = ("path", "size", "digest", "first", "count", "files", "bytes")


def index_problem(paths: Any, sizes: Any, digests: Any, files: Mapping[str, Any], n: int) -> str | None:
    """Why ``n`` ranks' index entries (path, size, digest; path None: no index file) cannot
    be trusted against ``files`` (path -> record with ``size_bytes``), or None."""
    if not all(isinstance(c, list) and len(c) == n for c in (paths, sizes, digests)):
        lens = ", ".join(str(len(c)) if isinstance(c, list) else "?" for c in (paths, sizes, digests))
        return f"described index columns (path, size, digest) list {lens} ranks, not {n}"
    if not set(map(type, sizes)) <= {int} or not set(map(type, digests)) <= {str}:
        return "described index sizes and digests are not integers and strings"
    for path, size, dg in zip(paths, sizes, digests):
        if path is None:
            if size != 0 or dg != "":
                return "a rank without an index file has an index size or digest"
            continue
        rec = files.get(path) if isinstance(path, str) else None
        if rec is None or path.startswith("../"):  # (the paths of files were checked already)
            return f"index file {str(path)[:80]!r} is not a file of its step"
        if rec.get("size_bytes") != size:
            return f"index file {path[:80]!r} is not listed in files with its size"
    return None


def chunk_files_problem(paths: Any, ends: Any, files: Mapping[str, Any]) -> str | None:
    """Why the chunk files (path, end of the last byte referenced) cannot be trusted, or None."""
    if not (isinstance(paths, list) and isinstance(ends, list) and len(paths) == len(ends)):
        return "described chunk_files columns differ in length"
    if not set(map(type, ends)) <= {int} or (ends and min(ends) < 0) or not set(map(type, paths)) <= {str}:
        return "described chunk_files are not paths with non-negative ends"
    for rel, end in zip(paths, ends):
        if not safe_chunk_path(rel):
            return f"described chunk file {rel[:80]!r} {NOT_A_DATA_FILE}"
        size = files.get(rel, {}).get("size_bytes")
        if size is not None and end > size:
            return f"described chunks reach byte {end} of {rel[:80]!r}, which has {size}"
    return None


def encode_page(
    step: int,
    first: int,
    files: Mapping[str, Any],
    index: Sequence[Sequence[Any] | None],
    chunk_files: Mapping[str, int],
) -> bytes:
    """The page of ranks ``first`` .. ``first + len(index) - 1``: their ``files`` (path ->
    ``{"size_bytes", "rank"}``), each one's index entry (``[path, size, digest]`` or None)
    and the chunk files their index files name with the end of the last byte referenced."""
    paths = sorted(chunk_files)
    doc = {
        "page_schema": PAGE_SCHEMA,
        "step": step,
        "first": first,
        "count": len(index),
        "files": dict(sorted(files.items())),
        "index": {
            "path": [e[0] if e else None for e in index],
            "size": [e[1] if e else 0 for e in index],
            "digest": [e[2] if e else "" for e in index],
        },
        "chunk_files": {"path": paths, "end": [chunk_files[p] for p in paths]},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class Page:
    """One page, checked: its ranks' files, index entries and chunk-file ends."""

    first: int
    count: int
    files: dict[str, dict[str, Any]]
    index: tuple[list[Any], list[int], list[str]]
    ends: dict[str, int]

    def entry(self, rank: int) -> tuple[str | None, int, str]:
        i = rank - self.first
        return self.index[0][i], self.index[1][i], self.index[2][i]


def parse_page(data: bytes, *, step: int | None, first: int, count: int) -> Page:
    """A page's bytes as a ``Page``; raises ``ValueError`` saying what is wrong."""
    try:
        doc = loads_untrusted(data, max_bytes=MAX_PAGE_BYTES)
    except UntrustedJSONError as e:
        raise ValueError(str(e)) from None
    if not isinstance(doc, dict) or doc.get("page_schema") != PAGE_SCHEMA:
        raise ValueError(f"has page_schema {str(doc.get('page_schema') if isinstance(doc, dict) else doc)[:20]}")
    if step is not None and (type(doc.get("step")) is not int or doc["step"] != step):
        raise ValueError(f"says it is of step {str(doc.get('step'))[:20]}")
    got = (doc.get("first"), doc.get("count"))
    if not (type(got[0]) is int and type(got[1]) is int and got == (first, count)):  # (true is no 1)
        raise ValueError(f"says it holds ranks from {str(doc.get('first'))[:20]}, {str(doc.get('count'))[:20]} of them")
    files, index, cf = doc.get("files"), doc.get("index"), doc.get("chunk_files")
    if not (isinstance(files, dict) and isinstance(index, dict) and isinstance(cf, dict)):
        raise ValueError("lacks its files, index or chunk_files object")
    for rel, rec in files.items():
        if not (safe_relative_path(rel) and rel.startswith("data/")):
            raise ValueError(f"lists file {rel[:80]!r}, not a data file of its step")
        size, rank = (rec.get("size_bytes"), rec.get("rank")) if type(rec) is dict else (None, None)
        if type(size) is not int or size < 0:
            raise ValueError(f"lists file {rel[:80]!r} without a size_bytes that is a non-negative integer")
        if type(rank) is not int or not first <= rank < first + count:
            raise ValueError(f"lists file {rel[:80]!r} of rank {str(rank)[:20]}, not one of its ranks")
    paths: Any = index.get("path")
    sizes: Any = index.get("size")
    digests: Any = index.get("digest")
    why = index_problem(paths, sizes, digests, files, count) or chunk_files_problem(
        cf.get("path"), cf.get("end"), files
    )
    if why is not None:
        raise ValueError(why)
    return Page(first, count, files, (paths, sizes, digests), dict(zip(cf["path"], cf["end"])))


class Pages:
    """The manifest's pages as columns (``PAGE_COLUMNS``), each page read through
    ``attach``'s reader once, on demand, and checked against its size and digest."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self.path: list[str] = d["path"]
        self.size: list[int] = d["size"]
        self.digest: list[str] = d["digest"]
        self.first: list[int] = d["first"]
        self.count: list[int] = d["count"]
        self.nfiles: list[int] = d["files"]
        self.nbytes: list[int] = d["bytes"]
        self._read: Callable[[str, int], bytes] | None = None
        self._digest: Callable[[bytes], str] | None = None
        self._where: Callable[[str], str] = str
        self._step: int | None = None
        self._loaded: dict[int, Page] = {}
        self._failed: dict[int, CorruptCheckpointError] = {}
        self._lock = threading.Lock()
        self.reads = 0

    def to_json(self) -> dict[str, Any]:
        cols = (self.path, self.size, self.digest, self.first, self.count, self.nfiles, self.nbytes)
        return dict(zip(PAGE_COLUMNS, cols))

    def __len__(self) -> int:
        return len(self.path)

    def problem(self, world_size: int, files: Mapping[str, Any]) -> str | None:
        """Why the columns cannot be trusted, or None: one entry per page, each a file of the
        step listed with its size and claiming no more ranks than that size can list, the
        pages' ranks covering 0 .. world_size - 1 in order."""
        cols = self.to_json()
        if not all(isinstance(c, list) and len(c) == len(self.path) for c in cols.values()):
            return "described pages columns are not arrays of one length"
        for name in ("size", "first", "count", "files", "bytes"):
            c = cols[name]
            if c and (not set(map(type, c)) <= {int} or min(c) < 0):
                return f"described pages {name} are not non-negative integers"
        if not set(map(type, self.digest)) <= {str}:
            return "described pages digests are not strings"
        at = 0
        for path, size, first, count in zip(self.path, self.size, self.first, self.count):
            rec = files.get(path) if isinstance(path, str) else None
            if rec is None or path.startswith("../"):
                return f"page {str(path)[:80]!r} is not a file of its step"
            if rec.get("size_bytes") != size:
                return f"page {path[:80]!r} is not listed in files with its size"
            if first != at or count < 1:
                return f"page {path[:80]!r} holds ranks from {first}, {count} of them; the next rank is {at}"
            if count > max_page_ranks(size):  # (its ranks are never derived: damage, before any read)
                return (
                    f"page {path[:80]!r} of {size} bytes claims {count} ranks; a page spends at least "
                    f"{PAGE_BYTES_PER_RANK} bytes on each, so it can list {max_page_ranks(size)}"
                )
            at += count
        if at != world_size:
            return f"the pages hold {at} ranks, not the world's {world_size}"
        return None

    def attach(
        self,
        read: Callable[[str, int], bytes],
        digest: Callable[[bytes], str],
        where: Callable[[str], str],
        step: int | None,
    ) -> None:
        self._read, self._digest, self._where, self._step = read, digest, where, step

    def page_of(self, rank: int) -> int:
        return bisect_right(self.first, rank) - 1

    def get(self, p: int) -> Page:
        """Page ``p``, read and checked on first use (damage is read once, then said again)."""
        got = self._loaded.get(p)
        if got is not None:
            return got
        with self._lock:
            got = self._loaded.get(p)
            if got is None:
                if p in self._failed:
                    raise CorruptCheckpointError(str(self._failed[p]))
                try:
                    got = self._loaded[p] = self._parse(p)
                except CorruptCheckpointError as e:
                    self._failed[p] = e
                    raise
            return got

    def rank(self, rank: int) -> Page:
        return self.get(self.page_of(rank))

    def all(self) -> list[Page]:
        return [self.get(p) for p in range(len(self.path))]

    def files(
        self, on_damage: Callable[[str, CorruptCheckpointError], None] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Every page's files (reads every page); a file two pages list is damage. With
        ``on_damage(page path, error)``, a damaged page is said there and skipped (``verify``
        checks the files of every page that reads), else raised."""
        out: dict[str, dict[str, Any]] = {}
        for p in range(len(self.path)):
            try:
                page = self.get(p)
            except CorruptCheckpointError as e:
                if on_damage is None:
                    raise
                on_damage(self.path[p], e)
                continue
            both = page.files.keys() & out.keys()
            if both:
                raise self._damage(p, f"lists {sorted(both)[0][:80]!r}, which an earlier page lists too")
            out.update(page.files)
        return out

    def file_ends(self, *, skip_damaged: bool = False) -> dict[str, int]:
        """Every chunk file the pages' index files name, with its end (reads every page;
        ``skip_damaged``: of the pages that read)."""
        out: dict[str, int] = {}
        for p in range(len(self.path)):
            try:
                page = self.get(p)
            except CorruptCheckpointError:
                if not skip_damaged:
                    raise
                continue
            for rel, end in page.ends.items():
                out[rel] = max(out.get(rel, 0), end)
        return out

    def _parse(self, p: int) -> Page:
        path, size, first, count = self.path[p], self.size[p], self.first[p], self.count[p]
        if self._read is None or self._digest is None:
            raise CorruptCheckpointError(
                "this manifest keeps its ranks' records in pages, and it was parsed without its storage: "
                "load it with shardkeeper.core.commit.committed.load_manifest"
            )
        if size > MAX_PAGE_BYTES:
            raise self._damage(p, f"is {size} bytes, more than the {MAX_PAGE_BYTES} a reader accepts")
        try:
            data = self._read(path, size)
        except CheckpointNotFoundError:
            raise self._damage(p, "is missing") from None
        self.reads += 1
        if len(data) != size or self._digest(data) != self.digest[p]:
            raise self._damage(p, "does not match the size and digest the manifest records for it")
        try:
            page = parse_page(data, step=self._step, first=first, count=count)
        except (ValueError, TypeError, LookupError, AttributeError) as e:
            raise self._damage(p, str(e)[:300]) from None
        nbytes = sum(r["size_bytes"] for r in page.files.values())
        if (len(page.files), nbytes) != (self.nfiles[p], self.nbytes[p]):
            raise self._damage(
                p,
                f"lists {len(page.files)} files of {nbytes} bytes, the manifest says {self.nfiles[p]} of "
                f"{self.nbytes[p]}",
            )
        return page

    def _damage(self, p: int, why: str) -> CorruptCheckpointError:
        last = self.first[p] + self.count[p] - 1
        return CorruptCheckpointError(
            f"page {self._where(self.path[p])} (the records of ranks {self.first[p]} to {last}) {why}; the "
            f"checkpoint is damaged: restore another step, or run `shardkeeper verify` on the root"
        )


__all__ = [
    "MAX_PAGE_BYTES",
    "PAGE_COLUMNS",
    "PAGE_SCHEMA",
    "Page",
    "Pages",
    "chunk_files_problem",
    "encode_page",
    "index_problem",
    "parse_page",
]
