"""The checks of an untrusted manifest: its envelope (``check_envelope``: format_version,
``requires`` and the members it names, the top-level fields' JSON types), then everything
restore relies on (``manifest_problem``: digests, sizes, paths, encodings, tiling), once, so
later reads need no per-field checks. Each names what it finds wrong.

Layering: below the manifest (format/manifest.py, whose ``loads`` and ``problem`` run these)
and above the records, the leaves and the features they compare against; it reads a
manifest's fields (``ManifestFields``) without importing the ``Manifest`` class, so the
manifest can import it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from shardkeeper.core.errors import CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.bounds import MAX_WORLD_SIZE
from shardkeeper.core.format.features import (
    DESCRIBED,
    ENCODINGS,
    ENCRYPTION,
    EXTENDED_JSON,
    FEATURES,
    FORMAT_VERSION,
    PAGES,
)
from shardkeeper.core.format.leaves import leaves_json
from shardkeeper.core.format.records import (
    DTYPES,
    NOT_A_DATA_FILE,
    LeafRecord,
    encoded_length_problem,
    safe_chunk_path,
    safe_relative_path,
)
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.format.tiling import check_tiling_boxes

#: Digest blocks larger than this are refused: a reader holds whole blocks in memory.
MAX_DIGEST_BLOCK_BYTES = 1 << 30
#: Top-level fields and their JSON types (an integer is never a boolean); the rest is optional.
_REQUIRED: dict[str, type] = {
    "step": int,
    "world_size": int,
    "digest_algorithm": str,
    "digest_block_bytes": int,
    "files": dict,
    "leaves": dict,
}
_OPTIONAL: dict[str, type] = {
    "created_at": str,
    "attempt": str,
    "per_rank_prefixes": list,
    "metadata": dict,
    "encryption": dict,
    "requires": list,
}


class ManifestFields(Protocol):
    """What ``manifest_problem`` reads of a manifest (``Manifest`` has these fields)."""

    step: int
    world_size: int
    leaves: Mapping[str, LeafRecord]
    files: dict[str, dict[str, Any]]
    digest_algorithm: str
    digest_block_bytes: int
    per_rank_prefixes: tuple[str, ...]


def declares_extended(d: Any) -> bool:
    """Whether a parsed manifest may hold extended JSON values: it requires them, or it has a
    format_version other than this one (parsed so, only so that its version is refused as
    such by ``check_envelope``, never read)."""
    if not isinstance(d, dict):
        return False
    requires = d.get("requires")
    return (isinstance(requires, list) and EXTENDED_JSON in requires) or d.get("format_version") != FORMAT_VERSION


def check_envelope(d: Any, where: str) -> tuple[str, ...]:
    """The features a parsed manifest ``d`` (``where`` names it) requires, once its envelope
    is one this code reads: else ``CorruptCheckpointError``, or ``IncompatibleFormatError``
    for another format_version or a feature it does not know, naming what is wrong and the
    remedy."""
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
    if version != FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"manifest {where}{_of_step(d)} has format_version {str(version)[:24]}, and this shardkeeper "
            f"reads format_version {FORMAT_VERSION} only: a pre-release build of shardkeeper wrote it. "
            f"Read it with the build that wrote it, or re-save the checkpoint with this one (restore it "
            f"there, then save it here)"
        )
    requires = d.get("requires", [])
    if type(requires) is not list or not all(type(r) is str for r in requires) or len(set(requires)) < len(requires):
        raise CorruptCheckpointError(
            f"manifest {where} is malformed: requires is {_short(requires)}, not a list of distinct "
            f"feature names; the checkpoint is damaged: restore another step"
        )
    unknown = sorted(set(requires) - FEATURES)
    if unknown:
        raise IncompatibleFormatError(
            f"manifest {where}{_of_step(d)} requires {', '.join(map(_short, unknown[:3]))}, which this "
            f"shardkeeper does not know (it knows {', '.join(sorted(FEATURES))}): a newer shardkeeper "
            f"wrote the step; upgrade shardkeeper-core to read it"
        )
    why = _fields_problem(d) or _members_problem(d, set(requires))
    if why is not None:
        raise CorruptCheckpointError(
            f"manifest {where} is malformed: {why}; the checkpoint is damaged: restore another step"
        )
    return tuple(requires)


def _members_problem(d: dict[str, Any], requires: set[str]) -> str | None:
    """Which member ``requires`` names without its member, or the reverse, or None: a reader
    that does not know a feature ignores its member, so a member must be required."""
    described = d.get("described")
    enc = d.get("encryption")
    members = {
        ENCRYPTION: ("encryption", "encryption" in d),
        DESCRIBED: ("described", "described" in d),
        PAGES: ("described.pages", isinstance(described, dict) and "pages" in described),
    }
    for feature, (member, present) in members.items():
        if present and feature not in requires:
            return f"it has the member {member} but does not require {feature!r}"
        if feature in requires and not present:
            return f"it requires {feature!r} but has no member {member}"
    if isinstance(enc, dict) and type(enc.get("root")) is not str:
        return "its encryption member names no root it is bound to"
    return None


def _of_step(d: dict[str, Any]) -> str:
    step = d.get("step")
    return f" (step {step})" if type(step) is int else ""


def manifest_problem(m: ManifestFields) -> str | None:
    """Why manifest ``m`` cannot be trusted, or None: what restore relies on, checked once
    (types, sizes, digest counts, paths), so later reads need no per-field checks."""
    why = _scalars_problem(m) or _files_problem(m.files)
    if why is not None:
        return why
    # (JSON nesting was bounded when the manifest was parsed: format/untrusted.py.)
    if isinstance(m.leaves, TableLeaves):  # the chunk table: checked in linear passes
        why = m.leaves.problem(m.files, m.world_size)
        if why is not None:
            return why
        raw = m.leaves.objects()
    else:
        raw = leaves_json(m.leaves)
    if "" in m.leaves:
        return "a leaf has an empty key"
    return _leaves_problem(raw, m.files, m.digest_block_bytes)


def _scalars_problem(m: ManifestFields) -> str | None:
    """Which of the digest algorithm, block size, step, world size and rank prefixes is out of
    range, or None."""
    from shardkeeper.core.format.digest import algorithms

    if m.digest_algorithm not in algorithms():
        return f"unknown digest algorithm {m.digest_algorithm!r}"
    if not 0 < m.digest_block_bytes <= MAX_DIGEST_BLOCK_BYTES or m.step < 0 or m.world_size < 1:
        return "digest_block_bytes, step or world_size out of range"
    if m.world_size > MAX_WORLD_SIZE:  # (before anything is derived from the ranks)
        return f"world_size {str(m.world_size)[:24]} is more than the {MAX_WORLD_SIZE} ranks a reader accepts"
    if not all(isinstance(p, str) for p in m.per_rank_prefixes):
        return "per_rank_prefixes is not a list of strings"
    return None


def _files_problem(files: dict[str, dict[str, Any]]) -> str | None:
    """Which listed file has a path outside the root or no valid size, or None."""
    for rel, rec in files.items():
        if not safe_relative_path(rel):
            return f"file {_short(rel)} is not a path inside the root"
        size = rec.get("size_bytes") if type(rec) is dict else None
        if type(size) is not int or size < 0:
            return f"file {_short(rel)} has no size_bytes that is a non-negative integer"
    return None


def _leaves_problem(raw: dict[str, Any], files: dict[str, dict[str, Any]], block: int) -> str | None:
    """Which JSON leaf of ``raw`` is malformed, and why (prefixed by its key), or None."""
    key = ""
    chunk_safe: dict[str, bool] = {}  # each chunk file's path checked once
    try:
        for key, leaf in raw.items():
            why = _leaf_problem(key, leaf, files, block, chunk_safe)
            if why is not None:
                return f"{key}: {why}"
    except (LookupError, TypeError, AttributeError) as e:
        return f"{key}: malformed leaf ({type(e).__name__}: {e})"
    return None


def _leaf_problem(
    key: str, leaf: Any, files: dict[str, dict[str, Any]], block: int, chunk_safe: dict[str, bool]
) -> str | None:
    """Why leaf ``key`` is malformed (its kind, dtype, shape, chunks, their tiling), or None;
    a missing or mistyped field raises ``LookupError`` or ``TypeError``."""
    kind = leaf["kind"]
    if kind == "object":
        return None if "value" in leaf else "an object leaf without a value"
    if kind not in ("tensor", "bytes"):
        return f"unknown leaf kind {kind!r}"
    dtype = leaf["dtype"]
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r}"
    shape = leaf["shape"]
    if not _is_sizes(shape):
        return f"shape {_short(shape)} is not a list of sizes"
    if kind == "bytes" and (dtype != "uint8" or len(shape) != 1):
        return "a bytes leaf must be a 1-d uint8 array"
    chunks = leaf["chunks"]
    if not isinstance(chunks, list):
        return "chunks is not a list"
    for c in chunks:
        why = _chunk_problem(c, dtype, len(shape), files, block, chunk_safe)
        if why is not None:
            return why
    return check_tiling_boxes(key, shape, [(c["offsets"], c["shape"]) for c in chunks])


def _chunk_problem(
    c: Any, dtype: str, ndim: int, files: dict[str, dict[str, Any]], block: int, chunk_safe: dict[str, bool]
) -> str | None:
    """Why chunk ``c`` of an ``ndim``-d ``dtype`` leaf is malformed (its file, byte range, box,
    encoding, digest count), or None."""
    f, offset, length = c["file"], c["offset"], c["length"]
    offs, cshape, digests = c["offsets"], c["shape"], c["digests"]
    ok = chunk_safe.get(f) if isinstance(f, str) else False
    if ok is None:
        ok = chunk_safe[f] = safe_chunk_path(f)
    if not ok:
        return f"chunk file {_short(f)} {NOT_A_DATA_FILE}"
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return f"chunk offset/length {offset!r}/{length!r} out of range"
    if not _is_sizes(offs) or not _is_sizes(cshape) or len(offs) != ndim or len(cshape) != ndim:
        return (
            f"chunk offsets/shape {_short(offs)}/{_short(cshape)} are not "
            f"{ndim} non-negative integers each (the tensor's rank)"
        )
    nbytes = math.prod(cshape) * DTYPES[dtype][1]
    encoding = c.get("encoding", "raw")
    if encoding != "raw":
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            return f"unknown chunk encoding {_short(encoding)}"
        if not isinstance(c.get("content", ""), str) or length == 0:
            return "encoded chunk without content id or bytes"
        why = encoded_length_problem(encoding, length, nbytes)
        if why is not None:
            return why
    if not isinstance(digests, str):
        return "chunk digests are not a comma-separated string"
    ndig = digests.count(",") + 1 if digests else 0
    if ndig != -(-length // block):
        return f"chunk of {length} bytes has {ndig} digests"
    if encoding == "raw" and length != nbytes:
        return f"chunk of shape {cshape} {dtype} has {length} bytes"
    frec = files.get(f)  # absent: a reference into another step's files
    if frec is not None and offset + length > frec["size_bytes"]:
        return f"chunk [{offset}, {offset + length}) lies beyond the end of {_short(f)}"
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
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(x), type(x).__name__)


def _is_sizes(x: Any) -> bool:
    return isinstance(x, list) and all(type(n) is int and n >= 0 for n in x)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["MAX_DIGEST_BLOCK_BYTES", "ManifestFields", "check_envelope", "declares_extended", "manifest_problem"]
