"""The manifest: the one file whose presence commits a checkpoint.

A versioned JSON document listing every leaf (tensor, object or bytes), every chunk of every
tensor leaf with its file, byte range, global offsets, shape, encoding and block digests, and
every file with its size. See ``docs/format.md`` for the normative description.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import CorruptCheckpointError, IncompatibleFormatError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

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


@dataclass(frozen=True)
class ChunkRecord:
    """One stored piece of a tensor leaf: a box of the global tensor, row-major bytes."""

    file: str  # relative to the step directory ("data/..."; "../step-.../data/..." for a reference)
    offset: int  # byte offset of the chunk's first byte in the file
    length: int  # stored byte length
    offsets: tuple[int, ...]  # global offsets of the box
    shape: tuple[int, ...]  # shape of the box
    digests: tuple[str, ...]  # one per digest block of the stored bytes
    encoding: str = "raw"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "digests": list(self.digests),
        }
        if self.encoding != "raw":
            d["encoding"] = self.encoding
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkRecord:
        return cls(
            file=d["file"],
            offset=int(d["offset"]),
            length=int(d["length"]),
            offsets=tuple(int(x) for x in d["offsets"]),
            shape=tuple(int(x) for x in d["shape"]),
            digests=tuple(d["digests"]),
            encoding=d.get("encoding", "raw"),
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
        return cls(
            kind=kind,
            dtype=d["dtype"],
            shape=tuple(int(x) for x in d["shape"]),
            chunks=tuple(ChunkRecord.from_json(c) for c in d["chunks"]),
        )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype) if self.kind != "object" else 0


@dataclass
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    world_size: int
    leaves: dict[str, LeafRecord]
    files: dict[str, dict[str, Any]]  # relative path -> {"size_bytes": int, "rank": int}
    digest_algorithm: str
    digest_block_bytes: int
    per_rank_prefixes: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    attempt: str = ""
    format_version: int = FORMAT_VERSION

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
            "leaves": {k: v.to_json() for k, v in self.leaves.items()},
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str = "") -> Manifest:
        """Parse and validate a manifest; ``where`` names it in errors."""
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"manifest {where} is not valid JSON ({e}); the checkpoint is damaged: "
                f"restore another step, or run `shardkeeper verify` on the root"
            ) from e
        if not isinstance(d, dict) or not isinstance(d.get("format_version"), int):
            raise CorruptCheckpointError(
                f"manifest {where} has no integer format_version; it is not a shardkeeper "
                f"manifest or it is damaged"
            )
        version = d["format_version"]
        if version > FORMAT_VERSION:
            raise IncompatibleFormatError(
                f"manifest {where} has format_version {version}, newer than the {FORMAT_VERSION} "
                f"this shardkeeper reads; upgrade shardkeeper-core to restore it"
            )
        try:
            m = cls(
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                leaves={k: LeafRecord.from_json(v) for k, v in d["leaves"].items()},
                files=dict(d["files"]),
                digest_algorithm=str(d["digest_algorithm"]),
                digest_block_bytes=int(d["digest_block_bytes"]),
                per_rank_prefixes=tuple(d.get("per_rank_prefixes", ())),
                metadata=dict(d.get("metadata", {})),
                created_at=str(d.get("created_at", "")),
                attempt=str(d.get("attempt", "")),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"manifest {where} is malformed ({type(e).__name__}: {e}); the checkpoint is "
                f"damaged: restore another step"
            ) from e
        problem = m.problem()
        if problem is not None:
            raise CorruptCheckpointError(
                f"manifest {where} is inconsistent: {problem}; the checkpoint is damaged: "
                f"restore another step"
            )
        return m

    def problem(self) -> str | None:
        """Why this manifest cannot be trusted, or None: what restore relies on, checked once."""
        from shardkeeper.core.format.digest import algorithms

        if self.digest_algorithm not in algorithms():
            return f"unknown digest algorithm {self.digest_algorithm!r}"
        if self.digest_block_bytes <= 0 or self.step < 0 or self.world_size < 1:
            return "digest_block_bytes, step or world_size out of range"
        for key, leaf in self.leaves.items():
            if leaf.kind == "object":
                continue
            if leaf.dtype not in DTYPES:
                return f"{key}: unknown dtype {leaf.dtype!r}"
            isz = DTYPES[leaf.dtype][1]
            for c in leaf.chunks:
                if not safe_relative_path(c.file):
                    return f"{key}: chunk file {c.file!r} is not a path inside the root"
                if c.encoding == "raw" and c.length != c.numel * isz:
                    return f"{key}: chunk of {c.numel} {leaf.dtype} elements has {c.length} bytes"
                if len(c.digests) != -(-c.length // self.digest_block_bytes):
                    return f"{key}: chunk of {c.length} bytes has {len(c.digests)} digests"
                if c.offset < 0:
                    return f"{key}: negative chunk offset"
        for rel in self.files:
            if not safe_relative_path(rel):
                return f"file {rel!r} is not a path inside the root"
        return None

    def chunks(self) -> Iterator[tuple[str, ChunkRecord]]:
        for key, leaf in self.leaves.items():
            for c in leaf.chunks:
                yield key, c

    def referenced_files(self) -> set[str]:
        """Files (relative to the step directory) this manifest's chunks point at."""
        out = set(self.files)
        out.update(c.file for _, c in self.chunks())
        return out

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def safe_relative_path(rel: str) -> bool:
    """A chunk's file: ``data/...`` in its step, or ``../step-N/data/...`` of an earlier step.

    Anything else (absolute paths, other ``..`` uses) could make a restore from an untrusted
    bucket read outside the root, so it is rejected.
    """
    from shardkeeper.core.format.layout import parse_step_dir

    if not rel or rel.startswith("/") or "\\" in rel:
        return False
    parts = rel.split("/")
    if parts[0] == "..":
        if len(parts) < 3 or parse_step_dir(parts[1]) is None:
            return False
        parts = parts[2:]
    return all(p not in ("", ".", "..") for p in parts)


def check_tiling(key: str, shape: tuple[int, ...], chunks: Iterable[ChunkRecord]) -> str | None:
    """Return why ``chunks`` do not tile ``shape`` exactly, or None when they do.

    Exact tiling: every box lies inside the tensor, boxes are pairwise disjoint, and their
    volumes add up to the tensor's. Identical duplicate boxes are the caller's to drop first.
    """
    boxes = list(chunks)
    total = math.prod(shape)
    vol = 0
    for c in boxes:
        if len(c.offsets) != len(shape) or len(c.shape) != len(shape):
            return f"chunk at {list(c.offsets)} has rank {len(c.shape)}, tensor has {len(shape)}"
        for o, s, g in zip(c.offsets, c.shape, shape):
            if o < 0 or s < 0 or o + s > g:
                return f"chunk {list(c.offsets)}+{list(c.shape)} lies outside shape {list(shape)}"
        vol += c.numel
    if vol != total:
        return f"chunks cover {vol} of {total} elements"
    if len(boxes) > 1 and total > 0:
        # Sort by offsets; with the volume equal, any overlap means a hole elsewhere, but
        # overlapping boxes must still be caught explicitly (sweep over the first dimension).
        nonempty = sorted((c for c in boxes if c.numel > 0), key=lambda c: c.offsets)
        if len(shape) == 0:
            return None if len(nonempty) == 1 else "scalar stored more than once"
        for i, a in enumerate(nonempty):
            a_end0 = a.offsets[0] + a.shape[0]
            for b in nonempty[i + 1 :]:
                if b.offsets[0] >= a_end0:
                    break
                if all(
                    bo < ao + asz and ao < bo + bsz
                    for ao, asz, bo, bsz in zip(a.offsets, a.shape, b.offsets, b.shape)
                ):
                    return f"chunks {list(a.offsets)} and {list(b.offsets)} of {key} overlap"
    return None
