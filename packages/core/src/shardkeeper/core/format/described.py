"""Described leaves (docs/format.md 3.8): tensor leaves whose chunks follow
the closed-form rule of format/grid.py, listed once per leaf, with their per-chunk fields
(file, byte range, digests) in one *index file* per rank instead of the manifest.

A checkpoint of 2,000 tensors row-sharded over 16,384 ranks has 32 million chunks; listed in
the manifest they make gigabytes that every rank parses. Described, the manifest holds the
leaves (O(tensors)), the meshes and each rank's index file with its digest (O(ranks), or
O(groups) with pages, format/pages.py); a restoring rank derives which ranks wrote the boxes
it needs and reads only their index files (format/index_files.py), checked against their
digests, and every row against the rule.

Layering: over format/grid.py, the index files and pages, and the chunk table's columns
(format/columns.py); below the table-form leaves (format/table.py), which serve these leaves
beside the enumerated ones.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any

from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardkeeper.core.format.cells import overlapping_cells
from shardkeeper.core.format.described_checks import columns_problem
from shardkeeper.core.format.grid import (
    Cell,
    Mesh,
)
from shardkeeper.core.format.index_files import INDEX_SCHEMA, MAX_INDEX_BYTES, Index, encode_index, parse_index
from shardkeeper.core.format.index_rows import RankRows
from shardkeeper.core.format.pages import Pages, chunk_files_problem, index_problem
from shardkeeper.core.format.records import (
    DTYPES,
    ChunkRecord,
    LeafRecord,
)

_ITEM = {name: size for name, (_, size) in DTYPES.items()}


class DescribedLeaves:
    """The described leaves of a manifest as columns, and the index files that hold their
    chunks (read through ``attach``'s reader, each once, on demand)."""

    def __init__(self, d: Mapping[str, Any], width: int, block: int) -> None:
        self.keys: list[str] = d["keys"]
        self.kind: list[str] = d["kind"]
        self.dtype: list[str] = d["dtype"]
        self.ndim: list[int] = d["ndim"]
        self.shape: list[int] = d["shape"]
        self.layout: list[int] = d["layout"]
        self.replica: list[int] = d["replica"]
        self.layouts: list[Any] = d["layouts"]  # [mesh index, placements(, order)]
        self.meshes = [Mesh.from_json(m) for m in d["meshes"]]
        index, files = d["index"], d["chunk_files"]
        # per rank: its index file's path (null: it wrote no described chunk), size and digest
        self.index_path: list[str | None] = index["path"]
        self.index_size: list[int] = index["size"]
        self.index_digest: list[str] = index["digest"]
        # every file the index files' rows name, and the end of the last byte they reference
        self.file_path: list[str] = files["path"]
        self.file_end: list[int] = files["end"]
        # with pages: the per-rank records (index entries, chunk files) in pages instead
        pages = d.get("pages")
        self.pages: Pages | None = Pages(pages) if pages is not None else None
        self.width, self.block = width, block
        self._pos: dict[str, int] | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._read: Callable[[str, int], bytes] | None = None
        self._step: int | None = None
        self._digest: Callable[[bytes], str] | None = None
        self._where: Callable[[str], str] = str
        self._files: Mapping[str, Any] = {}
        self._ends: dict[str, int] = {}  # chunk_files, once checked
        self._loaded: dict[int, Index] = {}
        self._rows: dict[int, RankRows] = {}
        self._heads: dict[tuple[str, str, tuple[int, ...]], LeafRecord] = {}
        self._failed: dict[int, CorruptCheckpointError] = {}
        self._specs: list[tuple[Mesh, tuple[tuple[Any, ...], ...], tuple[int, ...] | None]] | None = None
        self._cells: dict[Any, list[Cell]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self.index_reads = 0
        #: (rank, key) -> boxes of the rule asked for, when a reader (``verify``) tracks them
        self.track: dict[tuple[int, str], int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "kind": self.kind,
            "dtype": self.dtype,
            "ndim": self.ndim,
            "shape": self.shape,
            "layout": self.layout,
            "replica": self.replica,
            "layouts": self.layouts,
            "meshes": [m.to_json(compact=self.pages is not None) for m in self.meshes],
            "index": {"path": self.index_path, "size": self.index_size, "digest": self.index_digest},
            "chunk_files": {"path": self.file_path, "end": self.file_end},
            **({"pages": self.pages.to_json()} if self.pages is not None else {}),
        }

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def pos(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = dict(zip(self.keys, range(len(self.keys))))
        return self._pos

    def shapes(self) -> list[tuple[int, ...]]:
        if self._shapes is None:
            nds = set(self.ndim)
            if len(nds) == 1 and len(self.shape) == len(self.ndim) * min(nds) > 0:  # one ndim: cut in C
                self._shapes = list(zip(*[iter(self.shape)] * min(nds)))
            else:
                sd = [0, *accumulate(self.ndim)]
                self._shapes = [tuple(self.shape[a:b]) for a, b in zip(sd, sd[1:])]
        return self._shapes

    def attach(
        self,
        read: Callable[[str, int], bytes],
        digest: Callable[[bytes], str],
        files: Mapping[str, Any],
        where: Callable[[str], str] = str,
        step: int | None = None,
    ) -> None:
        """Where the index files are read from (``read(path, size)``: the file, relative to the
        step directory, refused unread when it is not ``size`` bytes), how they are digested,
        the manifest's ``files`` (their sizes), how a path is named in errors, and the step."""
        self._read, self._digest, self._files, self._where, self._step = read, digest, files, where, step
        if self.pages is not None:
            self.pages.attach(read, digest, where, step)

    def problem(self, world_size: int, files: Mapping[str, Any]) -> str | None:
        """Why the columns cannot be trusted, or None (types, lengths, the rule's fields)."""
        why, specs = columns_problem(self, world_size)
        if why is not None:
            return why
        self._specs = [(m, pl, tuple(o) if o is not None else None) for m, pl, o in specs]
        ip, isz, idg, fp, fe = self.index_path, self.index_size, self.index_digest, self.file_path, self.file_end
        if self.pages is not None:  # every rank's records are in the pages
            if ip or isz or idg or fp or fe:
                return "a described manifest with pages lists index entries or chunk files too"
            return self.pages.problem(world_size, files)
        why = index_problem(ip, isz, idg, files, world_size) or chunk_files_problem(fp, fe, files)
        if why is not None:
            return why
        self._ends = dict(zip(fp, fe))
        return None

    def _spec(self, j: int) -> tuple[Mesh, tuple[tuple[Any, ...], ...], tuple[int, ...] | None]:
        if self._specs is None:  # (made when the manifest was checked; here for one assembled in memory)
            self._specs = [
                (self.meshes[sp[0]], tuple(tuple(p) for p in sp[1]), tuple(sp[2]) if len(sp) == 3 else None)
                for sp in self.layouts
            ]
        return self._specs[self.layout[j]]

    def head(self, key: str) -> LeafRecord | None:
        j = (self._pos if self._pos is not None else self.pos).get(key)
        return None if j is None else self.head_at(j)

    def head_at(self, j: int) -> LeafRecord:
        """Leaf ``j`` without its chunks: one record shared by the leaves of one kind, dtype
        and shape (records are frozen; a manifest of 100,000 tensors has a few shapes)."""
        shapes = self._shapes if self._shapes is not None else self.shapes()
        memo = (self.kind[j], self.dtype[j], shapes[j])
        rec = self._heads.get(memo)
        if rec is None:
            rec = LeafRecord.unchecked(*memo)
            if len(self._heads) < 65536:
                self._heads[memo] = rec
        return rec

    def overlapping(self, key: str, offsets: Sequence[int], shape: Sequence[int]) -> list[ChunkRecord]:
        """The chunks of leaf ``key`` that meet the box ``offsets``/``shape``: derived from
        the rule, their fields read from the index files of the ranks that wrote them."""
        return self.overlapping_many([(key, offsets, shape)])[0]

    def overlapping_many(self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[list[ChunkRecord]]:
        """``overlapping`` for each (key, offsets, shape) of ``boxes``, in one pass: leaves of one
        layout, shape and dtype asking for one box split alike, so their cells are derived once
        and each cell's rows come from its rank's index file in one batch (a restore of 100,000
        tensors of a few shapes derives a few sets of cells and makes 100,000 records)."""
        pos = self._pos if self._pos is not None else self.pos
        shapes = self._shapes if self._shapes is not None else self.shapes()
        layout, replica, dtype, ndim = self.layout, self.replica, self.dtype, self.ndim
        groups: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}
        for n, (key, offsets, shape) in enumerate(boxes):
            j = pos[key]
            if len(offsets) != ndim[j] or len(shape) != ndim[j]:
                continue  # a box of another number of dimensions meets none of this leaf's
            g = (layout[j], replica[j], shapes[j], dtype[j], tuple(offsets), tuple(shape))
            got = groups.get(g)
            if got is None:
                got = groups[g] = ([], [])
            got[0].append(key)
            got[1].append(n)
        out: list[list[ChunkRecord]] = [[] for _ in boxes]
        loaded, track = self._rows, self.track
        for (li, rep, full, dt, offsets, shape), (keys, where) in groups.items():
            memo_key = (li, rep, full, offsets, shape)
            cells: Iterable[Cell] | None = self._cells.get(memo_key)
            derived: list[Cell] | None = None  # the cells as they come, kept once all came
            if cells is None:
                mesh, pl, order = self._spec(pos[keys[0]])
                # one at a time, each rank's rows read as its cell comes: a rule that claims
                # more cells than the step's files back fails at the first one they do not
                cells, derived = overlapping_cells(full, mesh, pl, rep, offsets, shape, order), []
            item = _ITEM[dt]
            for rank, offs, box in cells:
                if derived is not None:
                    derived.append((rank, offs, box))
                rows = loaded.get(rank)
                made = (rows if rows is not None else self._rank_rows(rank)).chunks(keys, offs, box, item)
                for n, rec in zip(where, made):
                    if type(rec) is str:
                        raise self._damage(rank, rec)
                    out[n].append(rec)  # type: ignore[arg-type]
                if track is not None:
                    for key in keys:
                        track[(rank, key)] = track.get((rank, key), 0) + 1
            if derived is not None and len(self._cells) < 65536:
                self._cells[memo_key] = derived
        return out

    def record(self, key: str) -> LeafRecord:
        """Leaf ``key``, whose ``chunks``, on first access, read the index file of every rank
        that wrote one (its kind, dtype and shape need none)."""
        j = self.pos[key]
        rec = object.__new__(DescribedRecord)
        rec.__dict__.update(kind=self.kind[j], dtype=self.dtype[j], shape=self.shapes()[j], value=None)
        rec.__dict__.update(_source=self, _key=key, _chunks=None)
        return rec

    def all_chunks(self, key: str) -> tuple[ChunkRecord, ...]:
        shape = self.shapes()[self.pos[key]]
        return tuple(self.overlapping(key, (0,) * len(shape), shape)) if math.prod(shape) else ()

    def _rank_rows(self, rank: int) -> RankRows:
        """Rank ``rank``'s index file (read once) with the ends of the files its rows name."""
        index = self._load(rank)
        if self.pages is not None:  # the ends of the files this rank's index names: in its page
            ends, ends_in = self.pages.rank(rank).ends, "its page"
        else:
            if not self._ends:  # (set when the manifest was checked; built here for one assembled in memory)
                self._ends = dict(zip(self.file_path, self.file_end))
            ends, ends_in = self._ends, "the manifest"
        rows = self._rows[rank] = RankRows(rank, index, ends, ends_in)
        return rows

    def _load(self, rank: int) -> Index:
        got = self._loaded.get(rank)  # (a dict read is atomic: the lock only for a first read)
        if got is not None:
            return got
        with self._locks.setdefault(rank, threading.Lock()):  # one rank's file read once; others in parallel
            got = self._loaded.get(rank)
            if got is None:
                failed = self._failed.get(rank)
                if failed is not None:  # damage is read once, then said again for each leaf
                    raise CorruptCheckpointError(str(failed))
                try:
                    got = self._loaded[rank] = self._parse(rank)
                except CorruptCheckpointError as e:
                    self._failed[rank] = e
                    raise
            return got

    def _parse(self, rank: int) -> Index:
        path, size, digest = self._entry(rank)
        if path is None:
            where = "the manifest"
            if self.pages is not None and 0 <= rank < self.pages.first[-1] + self.pages.count[-1]:
                p = self.pages.page_of(rank)
                where = f"its page {self._where(self.pages.path[p])}"
            raise CorruptCheckpointError(
                f"the manifest's layout says rank {rank} wrote chunks, but {where} lists no index file of rank "
                f"{rank}; the checkpoint is damaged: restore another step, or run `shardkeeper verify` on the root"
            )
        if self._read is None or self._digest is None:
            raise CorruptCheckpointError(
                "this manifest's described leaves keep their chunks in index files, and it was parsed "
                "without its storage: load it with shardkeeper.core.commit.committed.load_manifest"
            )
        if size > MAX_INDEX_BYTES:
            raise self._damage(rank, f"is {size} bytes, more than the {MAX_INDEX_BYTES} a reader accepts")
        try:
            data = self._read(path, size)
        except CheckpointNotFoundError:
            raise self._damage(rank, "is missing") from None
        self.index_reads += 1
        if len(data) != size or self._digest(data) != digest:
            raise self._damage(rank, "does not match the size and digest the manifest records for it")
        try:
            return parse_index(data, rank=rank, step=self._step, width=self.width, block=self.block)
        except ValueError as e:
            raise self._damage(rank, str(e)) from None

    def _entry(self, rank: int) -> tuple[str | None, int, str]:
        """Rank ``rank``'s index file: path (None: none), size and digest, from its page."""
        if self.pages is not None:
            if not 0 <= rank < self.pages.first[-1] + self.pages.count[-1]:
                return None, 0, ""
            return self.pages.rank(rank).entry(rank)
        if not 0 <= rank < len(self.index_path):
            return None, 0, ""
        return self.index_path[rank], self.index_size[rank], self.index_digest[rank]

    def extra_rows(self, skip: Collection[str] = ()) -> list[str]:
        """What the index files list beyond the boxes the rule gave (``track`` counts those;
        every described leaf's chunks asked for, but the leaves in ``skip``, whose chunks could
        not all be read): rows of keys no rank of the rule wrote there, or more rows of a key
        than its boxes. Damage, said per file."""
        out = []
        for rank in self._readable_ranks():  # an index file no box of the rule led to is read here
            try:
                if rank not in self._loaded and self._entry(rank)[0] is not None:
                    self._load(rank)
            except CorruptCheckpointError as e:  # (said where its leaves were asked for)
                if str(e) not in out and rank not in self._failed:
                    out.append(str(e))
        for rank, (rows, _, _, _) in sorted(self._loaded.items()):
            for key, run in rows.items():
                n = 1 if isinstance(run, int) else run[1]
                if key in skip:
                    continue
                used = (self.track or {}).get((rank, key), 0)
                if n != used:
                    path = self._where(self._entry(rank)[0] or "(none)")
                    out.append(
                        f"index file {path} of rank {rank} lists {n} row(s) of {key[:80]!r}, where the layout "
                        f"gives {used} box(es) of rank {rank}"
                    )
        return out

    def _readable_ranks(self) -> Iterator[int]:
        """Every rank, but those of a page that cannot be read (its damage is said on its own,
        once: its ranks are never walked one by one, however many the manifest claims)."""
        if self.pages is None:
            yield from range(len(self.index_path))
            return
        pages = self.pages
        for p in range(len(pages.path)):
            try:
                pages.get(p)
            except CorruptCheckpointError:
                continue
            yield from range(pages.first[p], pages.first[p] + pages.count[p])

    def file_ends(self) -> dict[str, int]:
        """Every chunk file the index files name, with the end of the last byte referenced
        (with pages: read from every page)."""
        if self.pages is not None:
            return self.pages.file_ends()
        return dict(zip(self.file_path, self.file_end))

    def _damage(self, rank: int, why: str) -> CorruptCheckpointError:
        try:
            path = self._entry(rank)[0] or "(none)"
        except CorruptCheckpointError:  # (its page is damaged: said on its own)
            path = f"(of rank {rank})"
        return CorruptCheckpointError(
            f"index file {self._where(path)} of rank {rank} {why}; the checkpoint is damaged: restore "
            f"another step, or run `shardkeeper verify` on the root"
        )


class DescribedRecord(LeafRecord):
    """A described tensor leaf: a ``LeafRecord`` whose chunks are read from the index files
    when first asked for, so that walking a manifest's leaves reads none."""

    @property
    def chunks(self) -> tuple[ChunkRecord, ...]:
        got = self.__dict__["_chunks"]
        if got is None:
            got = self.__dict__["_source"].all_chunks(self.__dict__["_key"])
            self.__dict__["_chunks"] = got
        return got  # type: ignore[no-any-return]


__all__ = ["DescribedRecord", "INDEX_SCHEMA", "MAX_INDEX_BYTES", "DescribedLeaves", "encode_index"]
