"""The manifest: the one file whose presence commits a checkpoint.

A versioned JSON document listing every leaf (tensor, object or bytes), every chunk of every
tensor leaf with its file, byte range, global offsets, shape, encoding and block digests, and
every file with its size. See ``docs/format.md`` for the normative description.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.bounds import ZSTD_MAX_EXPANSION, max_decoded_bytes
from shardkeeper.core.format.fastjson import orjson as _orjson
from shardkeeper.core.format.jsonvalue import (
    EXTENDED_MEMBER,
    JsonValueError,
    check_value,
    describe_problem,
    dumps_extended,
)
from shardkeeper.core.format.table import (
    DIGEST_HEX,
    LEAF_TABLE_VERSION,
    TABLE_VERSION,
    ChunkTable,
    LeafTable,
    RawLeaves,
    TableLeaves,
    no_gc,
)
from shardkeeper.core.format.tiling import check_tiling_boxes
from shardkeeper.core.format.untrusted import UntrustedJSONError, loads_untrusted

#: The format_version this code writes (2 added chunk encodings; a version 1 manifest reads
#: exactly as before), unless the manifest needs a later one (``EXTENDED_JSON_VERSION``).
FORMAT_VERSION = 5  # 3: the chunk table (format/table.py, TABLE_VERSION); 4: encryption; 5: the leaf table
#: The format_version that introduced extended JSON values (format/jsonvalue.py): NaN,
#: infinities and integers beyond 64 bits in metadata and object leaves, declared by the
#: top-level ``extended_json`` member. Written only by manifests that hold such a value, so
#: that every other checkpoint stays readable by readers of version 5.
EXTENDED_JSON_VERSION = 6
#: The format_version whose encrypted checkpoints are bound to their root (codec/crypto.py):
#: the manifest's encryption member names the root, and data files authenticate it.
ROOT_BOUND_VERSION = 6
#: The newest format_version this code reads.
READ_VERSION = 6
#: The format_version that introduced encrypted data files and the manifest's "encryption"
#: member (docs/format.md 4.2): a reader of version 3 would take ciphertext for damage.
ENCRYPTION_VERSION = 4
#: Chunk encodings and the format_version that introduced each (docs/codecs.md).
ENCODINGS: dict[str, int] = {"raw": 1, "zstd": 2, "shuffle-zstd": 2}
MANIFEST_NAME = "manifest.json"
#: A manifest larger than this is refused before it is read (parsed JSON takes several times
#: its size in memory); 10 million digest blocks take about 400 MB.
MAX_MANIFEST_BYTES = 1 << 30
#: Digest blocks larger than this are refused: a reader holds whole blocks in memory.
MAX_DIGEST_BLOCK_BYTES = 1 << 30
#: Top-level fields and their JSON types (an integer is never a boolean); the rest is optional.
_REQUIRED: dict[str, type] = {"step": int, "world_size": int, "digest_algorithm": str, "digest_block_bytes": int,
                              "files": dict, "leaves": dict}
_OPTIONAL: dict[str, type] = {"created_at": str, "attempt": str, "per_rank_prefixes": list, "metadata": dict,
                              "encryption": dict}

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
            f"dtype {dtype!r} is not supported by the shardkeeper format; supported: "
            f"{', '.join(DTYPES)}"
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

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        return self._split()[i]

    def __len__(self) -> int:
        if self._text is None:
            return len(self._packed) // self._width
        return self._text.count(",") + 1 if self._text else 0

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
            d["file"], d["offset"], d["length"], tuple(d["offsets"]), tuple(d["shape"]),
            BlockDigests(d["digests"]), d.get("encoding", "raw"), d.get("content", ""),
        )

    @classmethod
    def unchecked(cls, file: str, offset: int, length: int, offsets: tuple[int, ...], shape: tuple[int, ...],
                  digests: Sequence[str]) -> ChunkRecord:
        """A raw chunk record from fields already checked (a validated chunk table), set
        through the slots directly: faster than the frozen ``__init__`` (restore planning makes
        one per chunk it reads)."""
        rec = object.__new__(cls)
        s = _CHUNK_SLOTS
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


#: ChunkRecord's slot setters, in field order (``ChunkRecord.unchecked``).
_CHUNK_SLOTS = tuple(getattr(ChunkRecord, f).__set__ for f in
                     ("file", "offset", "length", "offsets", "shape", "digests", "encoding", "content"))


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


class LazyLeaves(RawLeaves):
    """Leaf records made on first access from the manifest's parsed JSON.

    A manifest of 100,000 tensors is parsed once; a restore of a few keys, ``ls`` or a
    retention pass then pays only for the leaves it touches.
    """

    def __getitem__(self, key: str) -> LeafRecord:
        leaf: LeafRecord | None = self._made.get(key)
        if leaf is None:
            leaf = self._made[key] = LeafRecord.from_json(self.raw[key])
        return leaf


def _leaves_json(leaves: Mapping[str, LeafRecord]) -> dict[str, Any]:
    if isinstance(leaves, LazyLeaves):
        return leaves.raw
    if isinstance(leaves, TableLeaves):
        return leaves.expanded()
    return {k: v.to_json() for k, v in leaves.items()}


@dataclass
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    world_size: int
    leaves: Mapping[str, LeafRecord]
    files: dict[str, dict[str, Any]]  # relative path -> {"size_bytes": int, "rank": int}
    digest_algorithm: str
    digest_block_bytes: int
    per_rank_prefixes: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    attempt: str = ""
    format_version: int = FORMAT_VERSION
    #: the "encryption" member of an encrypted checkpoint's manifest (codec/crypto.py
    #: ``seal_manifest`` appends it, with its MAC, after ``dumps``); None: not encrypted
    encryption: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "created_at": self.created_at,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "digest_algorithm": self.digest_algorithm,
            "digest_block_bytes": self.digest_block_bytes,
            "per_rank_prefixes": list(self.per_rank_prefixes),
            "metadata": self.metadata,
            "files": self.files,
            **_leaves_fields(self.leaves),
        }

    def object_values(self) -> dict[str, Any]:
        """Every value a user supplied, as written: ``metadata`` and each object leaf's value."""
        if isinstance(self.leaves, TableLeaves):
            objects = self.leaves.objects()
        elif isinstance(self.leaves, LazyLeaves):
            objects = {k: v for k, v in self.leaves.raw.items() if isinstance(v, dict) and v.get("kind") == "object"}
        else:
            objects = {k: v.to_json() for k, v in self.leaves.items() if v.kind == "object"}
        return {"metadata": self.metadata, **{k: v.get("value") for k, v in objects.items()}}

    def dumps(self) -> bytes:
        """The manifest's bytes. Values that standard JSON or a fast parser would not give back
        exactly (NaN, infinities, integers beyond 64 bits) are written in the extended form
        (format/jsonvalue.py), at format_version ``EXTENDED_JSON_VERSION``; a value that cannot
        come back at all (a lone surrogate, a non-string key) raises ``ValueError``."""
        extended = False
        for key, value in self.object_values().items():
            try:
                extended |= check_value(value)
            except JsonValueError as e:
                raise ValueError(describe_problem(key, e)) from None
        d = self.to_json()
        if extended:
            d["format_version"] = max(self.format_version, EXTENDED_JSON_VERSION)
            d[EXTENDED_MEMBER] = True
            return dumps_extended(d)
        if _orjson is not None:
            try:
                return _orjson.dumps(d)
            except (TypeError, _orjson.JSONEncodeError):
                pass
        return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str = "") -> Manifest:
        """Parse and validate a manifest; ``where`` names it in errors."""
        with no_gc():  # millions of small lists, no cycles: see table.no_gc
            return cls._loads(data, where)

    @classmethod
    def _loads(cls, data: bytes, where: str) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(too_large(where, len(data)))
        try:
            # NaN, infinities and big integers only where declared (jsonvalue.py)
            d = loads_untrusted(data, max_bytes=MAX_MANIFEST_BYTES, exact=True)
        except UntrustedJSONError as e:
            raise CorruptCheckpointError(
                f"manifest {where} {e}; the checkpoint is damaged: restore another step, or run "
                f"`shardkeeper verify` on the root"
            ) from None
        if not isinstance(d, dict) or type(d.get("format_version")) is not int:
            raise CorruptCheckpointError(
                f"manifest {where} has no integer format_version; it is not a shardkeeper "
                f"manifest or it is damaged: restore another step"
            )
        version = d["format_version"]
        if version < 1:
            raise CorruptCheckpointError(
                f"manifest {where} has format_version {version}; versions start at 1, so it is damaged: "
                f"restore another step"
            )
        if version > READ_VERSION:
            raise IncompatibleFormatError(
                f"manifest {where} has format_version {version}, newer than the {READ_VERSION} "
                f"this shardkeeper reads; upgrade shardkeeper-core to restore it"
            )
        if d.get(EXTENDED_MEMBER, False) is not False and (d[EXTENDED_MEMBER] is not True or version < EXTENDED_JSON_VERSION):
            raise CorruptCheckpointError(
                f"manifest {where} declares {EXTENDED_MEMBER}={_short(d[EXTENDED_MEMBER])} at format_version "
                f"{version}; extended JSON values are format_version {EXTENDED_JSON_VERSION} or later (true only), "
                f"so the manifest was edited or damaged: restore another step"
            )
        enc = d.get("encryption")
        if isinstance(enc, dict) and "root" in enc and version < ROOT_BOUND_VERSION:
            raise CorruptCheckpointError(
                f"manifest {where} names the root it is bound to but has format_version {version}; "
                f"bound checkpoints are format_version {ROOT_BOUND_VERSION} or later, so the manifest "
                f"was edited or damaged: restore another step"
            )
        if "encryption" in d and version < ENCRYPTION_VERSION:
            raise CorruptCheckpointError(
                f"manifest {where} has an encryption member but format_version {version}; "
                f"encrypted checkpoints are format_version {ENCRYPTION_VERSION} or later, so the "
                f"manifest was edited or damaged: restore another step"
            )
        why = _fields_problem(d)
        if why is not None:
            raise CorruptCheckpointError(
                f"manifest {where} is malformed: {why}; the checkpoint is damaged: restore another step"
            )
        try:
            m = cls(
                step=d["step"],
                world_size=d["world_size"],
                leaves=_read_leaves(d, version),
                files=d["files"],
                digest_algorithm=d["digest_algorithm"],
                digest_block_bytes=d["digest_block_bytes"],
                per_rank_prefixes=tuple(d.get("per_rank_prefixes", [])),
                metadata=d.get("metadata", {}),
                created_at=d.get("created_at", ""),
                attempt=d.get("attempt", ""),
                format_version=version,
                encryption=d.get("encryption"),
            )
        except (LookupError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"manifest {where} is malformed ({type(e).__name__}: {str(e)[:200]}); the "
                f"checkpoint is damaged: restore another step"
            ) from e
        try:
            problem = m.problem()
        except (LookupError, TypeError, ValueError, AttributeError, OverflowError) as e:
            # Every check names what it finds wrong; this is the net under them.
            problem = f"malformed ({type(e).__name__}: {str(e)[:200]})"
        if problem is not None:
            raise CorruptCheckpointError(
                f"manifest {where} is inconsistent: {problem}; the checkpoint is damaged: "
                f"restore another step"
            )
        return m

    def problem(self) -> str | None:
        """Why this manifest cannot be trusted, or None: what restore relies on, checked once
        (types, sizes, digest counts, paths), so later reads need no per-field checks."""
        from shardkeeper.core.format.digest import algorithms

        if self.digest_algorithm not in algorithms():
            return f"unknown digest algorithm {self.digest_algorithm!r}"
        block = self.digest_block_bytes
        if not 0 < block <= MAX_DIGEST_BLOCK_BYTES or self.step < 0 or self.world_size < 1:
            return "digest_block_bytes, step or world_size out of range"
        if not all(isinstance(p, str) for p in self.per_rank_prefixes):
            return "per_rank_prefixes is not a list of strings"
        # (JSON nesting was bounded when the manifest was parsed: format/untrusted.py.)
        safe: dict[str, bool] = {}
        for rel, rec in self.files.items():
            if not safe.setdefault(rel, safe_relative_path(rel)):
                return f"file {_short(rel)} is not a path inside the root"
            size = rec.get("size_bytes") if type(rec) is dict else None
            if type(size) is not int or size < 0:
                return f"file {_short(rel)} has no size_bytes that is a non-negative integer"
        if isinstance(self.leaves, TableLeaves):  # the chunk table: checked in linear passes
            why = self.leaves.problem(self.files, self.format_version)
            if why is not None:
                return why
            raw = self.leaves.objects()
        else:
            raw = _leaves_json(self.leaves)
        if "" in self.leaves:
            return "a leaf has an empty key"
        key = ""
        try:
            for key, leaf in raw.items():
                kind = leaf["kind"]
                if kind == "object":
                    if "value" not in leaf:
                        return f"{key}: an object leaf without a value"
                    continue
                if kind not in ("tensor", "bytes"):
                    return f"{key}: unknown leaf kind {kind!r}"
                dtype = leaf["dtype"]
                if dtype not in DTYPES:
                    return f"{key}: unknown dtype {dtype!r}"
                isz = DTYPES[dtype][1]
                shape = leaf["shape"]
                if not _is_sizes(shape):
                    return f"{key}: shape {_short(shape)} is not a list of sizes"
                if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
                    return f"{key}: a bytes leaf must be a 1-d uint8 array"
                ndim = len(shape)
                chunks = leaf["chunks"]
                if not isinstance(chunks, list):
                    return f"{key}: chunks is not a list"
                for c in chunks:
                    f, offset, length = c["file"], c["offset"], c["length"]
                    offs, cshape, digests = c["offsets"], c["shape"], c["digests"]
                    ok = safe.get(f) if isinstance(f, str) else False
                    if ok is None:
                        ok = safe[f] = isinstance(f, str) and safe_relative_path(f)
                    if not ok:
                        return f"{key}: chunk file {_short(f)} is not a path inside the root"
                    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
                        return f"{key}: chunk offset/length {offset!r}/{length!r} out of range"
                    if not _is_sizes(offs) or not _is_sizes(cshape) or len(offs) != ndim or len(cshape) != ndim:
                        return (
                            f"{key}: chunk offsets/shape {_short(offs)}/{_short(cshape)} are not "
                            f"{ndim} non-negative integers each (the tensor's rank)"
                        )
                    encoding = c.get("encoding", "raw")
                    if encoding != "raw":
                        since = ENCODINGS.get(encoding) if isinstance(encoding, str) else None
                        if since is None or since > self.format_version:
                            return (
                                f"{key}: chunk encoding {_short(encoding)} is unknown to "
                                f"format_version {self.format_version}"
                            )
                        if not isinstance(c.get("content", ""), str) or length == 0:
                            return f"{key}: encoded chunk without content id or bytes"
                        why = encoded_length_problem(encoding, length, math.prod(cshape) * isz)
                        if why is not None:
                            return f"{key}: {why}"
                    if not isinstance(digests, str):
                        return f"{key}: chunk digests are not a comma-separated string"
                    ndig = digests.count(",") + 1 if digests else 0
                    if ndig != -(-length // block):
                        return f"{key}: chunk of {length} bytes has {ndig} digests"
                    if encoding == "raw" and length != math.prod(cshape) * isz:
                        return f"{key}: chunk of shape {cshape} {dtype} has {length} bytes"
                    frec = self.files.get(f)  # absent: a reference into another step's files
                    if frec is not None and offset + length > frec["size_bytes"]:
                        return f"{key}: chunk [{offset}, {offset + length}) lies beyond the end of {_short(f)}"
                why = check_tiling_boxes(key, shape, [(c["offsets"], c["shape"]) for c in chunks])
                if why is not None:
                    return f"{key}: {why}"
        except (LookupError, TypeError, AttributeError) as e:
            return f"{key}: malformed leaf ({type(e).__name__}: {e})"
        return None

    def chunks(self) -> Iterator[tuple[str, ChunkRecord]]:
        for key, leaf in self.leaves.items():
            for c in leaf.chunks:
                yield key, c

    def referenced_files(self) -> set[str]:
        """Files (relative to the step directory) this manifest's chunks point at."""
        out = set(self.files)
        if isinstance(self.leaves, TableLeaves):
            return out | set(self.leaves.table.paths)
        out.update(c.file for _, c in self.chunks())
        return out

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def _leaves_fields(leaves: Mapping[str, LeafRecord]) -> dict[str, Any]:
    if isinstance(leaves, TableLeaves):
        return {"leaves": leaves.object_leaves, "leaf_table": leaves.leaf_table.to_json(),
                "chunk_table": leaves.table.to_json()}
    return {"leaves": _leaves_json(leaves)}


def _read_leaves(d: dict[str, Any], version: int) -> Mapping[str, LeafRecord]:
    """The leaves of a parsed manifest: per-chunk records; (format_version 3, 4) leaves that
    list rows of the ``chunk_table``; or (5) the ``leaf_table`` over the ``chunk_table``."""
    if "leaf_table" in d and version < LEAF_TABLE_VERSION:
        raise ValueError(f"a leaf_table in a format_version {version} manifest (introduced in {LEAF_TABLE_VERSION})")
    if "leaf_table" in d and "chunk_table" not in d:
        raise ValueError("a leaf_table without a chunk_table")
    if version >= TABLE_VERSION and "chunk_table" in d:
        width = DIGEST_HEX.get(str(d["digest_algorithm"]), 0)
        table = ChunkTable.from_json(_as_dict(d["chunk_table"]), width)
        block = int(d["digest_block_bytes"])
        if "leaf_table" in d:
            return TableLeaves(_as_dict(d["leaves"]), LeafTable.from_json(_as_dict(d["leaf_table"])), table, block)
        if version >= LEAF_TABLE_VERSION:  # writers of 5 and later always write both tables
            raise ValueError(f"a chunk_table without a leaf_table at format_version {version}")
        return TableLeaves.from_raw(_as_dict(d["leaves"]), table, block)
    return LazyLeaves(_as_dict(d["leaves"]))


def encoded_length_problem(encoding: str, length: int, box_bytes: int) -> str | None:
    """Why an encoded chunk of ``length`` stored bytes cannot hold a box of ``box_bytes``, or
    None: writers store a chunk that does not shrink raw, and one zstd frame decodes to at most
    ``ZSTD_MAX_EXPANSION`` times its length (format/bounds.py), so a larger box is damage that
    would otherwise become an allocation the file cannot back."""
    if length >= box_bytes:
        return f"chunk with encoding {encoding!r} has {length} stored bytes, not fewer than its box's {box_bytes}"
    if box_bytes > max_decoded_bytes(length):
        return (f"chunk with encoding {encoding!r} claims {box_bytes} bytes decoded from {length} stored bytes, "
                f"more than a zstd frame can hold (about {ZSTD_MAX_EXPANSION} times its length)")
    return None


def _fields_problem(d: dict[str, Any]) -> str | None:
    """Which top-level field is missing or of the wrong JSON type, or None."""
    for name, kind in _REQUIRED.items():
        if name not in d:
            return f"it lacks the required field {name!r}"
        if type(d[name]) is not kind:
            return f"{name} is {_json_type(d[name])}, not {_json_type(kind())}"
    for name, kind in _OPTIONAL.items():
        if name in d and type(d[name]) is not kind:
            return f"{name} is {_json_type(d[name])}, not {_json_type(kind())}"
    return None


def _json_type(x: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(x), type(x).__name__)


def _as_dict(x: Any) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise TypeError(f"expected an object, got {type(x).__name__}")
    return x


def _is_sizes(x: Any) -> bool:
    return isinstance(x, list) and all(type(n) is int and n >= 0 for n in x)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def too_large(where: str, size: int) -> str:
    return (
        f"manifest {where} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a reader accepts; "
        f"it is damaged or not a shardkeeper manifest: restore another step"
    )


def safe_relative_path(rel: str) -> bool:
    """A chunk's file: ``data/...`` in its step, or ``../step-N/data/...`` of an earlier step.

    Anything else (absolute paths, other ``..`` uses) could make a restore from an untrusted
    bucket read outside the root, so it is rejected.
    """
    from shardkeeper.core.format.layout import parse_step_dir

    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    if ":" in rel or any(ord(ch) < 32 for ch in rel):  # URLs, drive letters, control bytes
        return False
    parts = rel.split("/")
    if parts[0] == "..":
        if len(parts) < 3 or parse_step_dir(parts[1]) is None:
            return False
        parts = parts[2:]
    return all(p not in ("", ".", "..") for p in parts)


def check_tiling(key: str, shape: tuple[int, ...], chunks: Iterable[ChunkRecord]) -> str | None:
    """``check_tiling_boxes`` over chunk records."""
    return check_tiling_boxes(key, shape, [(c.offsets, c.shape) for c in chunks])
