"""A manifest's records: leaves (``LeafRecord``), the chunks of tensor leaves (``ChunkRecord``)
with their block digests (``BlockDigests``), the dtypes the format knows, and the checks that
concern one record alone (its file's path, an encoded chunk's length, a leaf's tiling).

Layering: below both forms of leaves (per-chunk JSON, format/leaves.py; the tables,
format/table.py) and the manifest (format/manifest.py), which all make or check these
records; it imports only leaf modules of the format (bounds, layout, tiling), so nothing
that holds records is needed to define them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.format.bounds import ZSTD_MAX_EXPANSION, max_decoded_bytes
from shardkeeper.core.format.layout import DATA_DIR, parse_step_dir
from shardkeeper.core.format.tiling import check_tiling_boxes

#: dtype name -> (safetensors dtype code, item size in bytes).
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} is not supported by the shardkeeper format; supported: {', '.join(DTYPES)}"
        ) from None


class BlockDigests(Sequence[str]):
    """A chunk's block digests, stored in the manifest as one comma-separated string.

    One JSON string per chunk instead of a list of strings: a manifest with millions of
    blocks parses several times faster, and the list is split (in C) only when a reader
    needs it.
    """

    __slots__ = ("_text", "_items", "_packed", "_width")

    def __init__(self, text: str) -> None:
        self._text: str | None = text
        self._items: tuple[str, ...] | None = None
        self._packed = ""
        self._width = 0

    @classmethod
    def packed(cls, hexdigits: str, width: int) -> BlockDigests:
        """Digests of ``width`` hex digits each, concatenated (a chunk table's form): split
        by width when needed, without building the comma-separated text first."""
        self = cls.__new__(cls)
        self._text, self._items, self._packed, self._width = None, None, hexdigits, width
        return self

    @classmethod
    def of(cls, digests: Iterable[str]) -> BlockDigests:
        return digests if isinstance(digests, BlockDigests) else cls(",".join(digests))

    @property
    def text(self) -> str:
        """The digests, comma-separated (the per-chunk JSON form)."""
        if self._text is None:
            self._text = ",".join(self._split())
        return self._text

    def _split(self) -> tuple[str, ...]:
        if self._items is None:
            if self._text is None:
                w, p = self._width, self._packed
                self._items = tuple([p[j : j + w] for j in range(0, len(p), w)])
            else:
                self._items = tuple(self._text.split(",")) if self._text else ()
        return self._items

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # int or slice, as Sequence has it
        return self._split()[i]

    def __len__(self) -> int:
        if self._text is None:
            return len(self._packed) // self._width
        return len(self._split())  # split once (cached): a scan of the text per call made block loops quadratic

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockDigests):
            return self.text == other.text
        if isinstance(other, (tuple, list)):
            return self._split() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"BlockDigests({self.text!r})"


@dataclass(frozen=True, slots=True)  # slots: restore planning holds one per chunk it reads
class ChunkRecord:
    """One stored piece of a tensor leaf: a box of the global tensor, row-major bytes."""

    file: str  # relative to the step directory ("data/..."; "../step-.../data/..." for a reference)
    offset: int  # byte offset of the chunk's first byte in the file
    length: int  # stored byte length
    offsets: tuple[int, ...]  # global offsets of the box
    shape: tuple[int, ...]  # shape of the box
    digests: Sequence[str]  # one per digest block of the stored bytes (a BlockDigests when read)
    encoding: str = "raw"
    content: str = ""  # encoded chunks: content id of the raw bytes (codec/incremental.py)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "digests": BlockDigests.of(self.digests).text,
        }
        if self.encoding != "raw":
            d["encoding"] = self.encoding
        if self.content:
            d["content"] = self.content
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkRecord:
        # Types were checked once for the whole manifest (Manifest.problem); no per-field casts.
        return cls(
            d["file"],
            d["offset"],
            d["length"],
            tuple(d["offsets"]),
            tuple(d["shape"]),
            BlockDigests(d["digests"]),
            d.get("encoding", "raw"),
            d.get("content", ""),
        )

    @classmethod
    def unchecked(
        cls,
        file: str,
        offset: int,
        length: int,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        digests: Sequence[str],
    ) -> ChunkRecord:
        """A raw chunk record from fields already checked (a validated chunk table), set
        through the slots directly: faster than the frozen ``__init__`` (restore planning makes
        one per chunk it reads)."""
        rec = object.__new__(cls)
        s = CHUNK_SLOTS
        s[0](rec, file)
        s[1](rec, offset)
        s[2](rec, length)
        s[3](rec, offsets)
        s[4](rec, shape)
        s[5](rec, digests)
        s[6](rec, "raw")
        s[7](rec, "")
        return rec

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: ChunkRecord's slot setters, in field order (``ChunkRecord.unchecked``, and restore
#: planning's batch of records, format/index_rows.py).
CHUNK_SLOTS = tuple(
    getattr(ChunkRecord, f).__set__
    for f in ("file", "offset", "length", "offsets", "shape", "digests", "encoding", "content")
)


@dataclass(frozen=True)
class LeafRecord:
    """A leaf of the canonical state: ``kind`` is ``tensor``, ``bytes`` or ``object``."""

    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    chunks: tuple[ChunkRecord, ...] = ()
    value: Any = None  # for objects: the JSON value

    def to_json(self) -> dict[str, Any]:
        if self.kind == "object":
            return {"kind": "object", "value": self.value}
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeafRecord:
        kind = d["kind"]
        if kind == "object":
            return cls(kind="object", value=d.get("value"))
        if kind not in ("tensor", "bytes"):
            raise ValueError(f"unknown leaf kind {kind!r}")
        return cls(kind, d["dtype"], tuple(d["shape"]), tuple([ChunkRecord.from_json(c) for c in d["chunks"]]))

    @classmethod
    def unchecked(cls, kind: str, dtype: str, shape: tuple[int, ...]) -> LeafRecord:
        """A tensor leaf without chunks from fields already checked (see ``ChunkRecord.unchecked``)."""
        rec = object.__new__(cls)
        rec.__dict__.update(kind=kind, dtype=dtype, shape=shape, chunks=(), value=None)
        return rec

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype) if self.kind != "object" else 0


def encoded_length_problem(encoding: str, length: int, box_bytes: int) -> str | None:
    """Why an encoded chunk of ``length`` stored bytes cannot hold a box of ``box_bytes``, or
    None: writers store a chunk that does not shrink raw, and one zstd frame decodes to at most
    ``ZSTD_MAX_EXPANSION`` times its length (format/bounds.py), so a larger box is damage that
    would otherwise become an allocation the file cannot back."""
    if length >= box_bytes:
        return f"chunk with encoding {encoding!r} has {length} stored bytes, not fewer than its box's {box_bytes}"
    if box_bytes > max_decoded_bytes(length):
        return (
            f"chunk with encoding {encoding!r} claims {box_bytes} bytes decoded from {length} stored bytes, "
            f"more than a zstd frame can hold (about {ZSTD_MAX_EXPANSION} times its length)"
        )
    return None


_CONTROL = re.compile("[\x00-\x1f]")


def safe_relative_path(rel: str) -> bool:
    """A path relative to a step directory that stays inside the root: a file of the step
    (``data/...``, ``pages/...``), or ``../step-N/...`` of another step.

    Anything else (absolute paths, other ``..`` uses) could make a restore from an untrusted
    bucket read outside the root, so it is rejected. Chunk files: ``safe_chunk_path``.
    """
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    if ":" in rel or _CONTROL.search(rel):  # URLs, drive letters, control bytes (in C)
        return False
    parts = rel.split("/")
    if parts[0] == "..":
        if len(parts) < 3 or parse_step_dir(parts[1]) is None:
            return False
        parts = parts[2:]
    return all(p not in ("", ".", "..") for p in parts)


#: How an error says that a chunk's file is not one ``safe_chunk_path`` accepts.
NOT_A_DATA_FILE = (
    "is not a path inside the root to a data file (data/... of its step, or ../step-N/data/... of another)"
)


def safe_chunk_path(rel: str) -> bool:
    """A chunk's file as format.md requires it: ``safe_relative_path`` and a data file,
    ``data/...`` or ``../step-N/data/...``. A chunk that names the manifest, a page or any
    other file of the root is refused: readers treat ``data/`` files alone as shard files (an
    encrypted checkpoint encrypts those alone)."""
    if not safe_relative_path(rel):
        return False
    parts = rel.split("/", 3)
    return (parts[0] == DATA_DIR and len(parts) > 1) or (parts[0] == ".." and len(parts) == 4 and parts[2] == DATA_DIR)


def check_tiling(key: str, shape: tuple[int, ...], chunks: Iterable[ChunkRecord]) -> str | None:
    """``check_tiling_boxes`` over chunk records."""
    return check_tiling_boxes(key, shape, [(c.offsets, c.shape) for c in chunks])


__all__ = [
    "BlockDigests",
    "CHUNK_SLOTS",
    "ChunkRecord",
    "DTYPES",
    "LeafRecord",
    "NOT_A_DATA_FILE",
    "check_tiling",
    "encoded_length_problem",
    "itemsize",
    "safe_chunk_path",
    "safe_relative_path",
]
