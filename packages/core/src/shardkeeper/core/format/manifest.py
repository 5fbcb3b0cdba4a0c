"""The manifest: the one file whose presence commits a checkpoint.

A JSON document of one format_version listing every leaf (tensor, object or bytes), every
chunk of every tensor leaf with its file, byte range, global offsets, shape, encoding and
block digests, every file with its size, and the features (``requires``) a reader needs
beyond the core schema. See ``docs/format.md`` for the normative description.

Layering: the top of the format package. ``Manifest`` and its (de)serialisation are here;
what it is made of and checked by sits below it, each apart so that none imports another in
a circle: the version and features (format/features.py), the records (format/records.py),
the leaves in either form (format/leaves.py, over the tables of format/table.py) and the
checks of an untrusted manifest (format/manifest_checks.py). This module also names the
records and record checks for their importers, so ``shardkeeper.core.format.manifest``
keeps the names it always had.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.errors import CorruptCheckpointError
from shardkeeper.core.format.columns import no_gc
from shardkeeper.core.format.fastjson import orjson as _orjson
from shardkeeper.core.format.features import DESCRIBED, ENCRYPTION, EXTENDED_JSON, FORMAT_VERSION, PAGES
from shardkeeper.core.format.jsonvalue import (
    JsonValueError,
    check_value,
    describe_problem,
    dumps_extended,
)
from shardkeeper.core.format.leaves import LazyLeaves, leaves_fields, read_leaves
from shardkeeper.core.format.logical_member import MEMBER, member_of, member_problem
from shardkeeper.core.format.manifest_checks import check_envelope, declares_extended, manifest_problem
from shardkeeper.core.format.pages import Pages
from shardkeeper.core.format.records import (
    DTYPES,
    BlockDigests,
    ChunkRecord,
    LeafRecord,
    check_tiling,
    encoded_length_problem,
    itemsize,
    safe_relative_path,
)
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.format.tiling import check_tiling_boxes
from shardkeeper.core.format.untrusted import UntrustedJSONError, loads_untrusted

MANIFEST_NAME = "manifest.json"
#: A manifest larger than this is refused before it is read (parsed JSON takes several times
#: its size in memory); 10 million digest blocks take about 400 MB.
MAX_MANIFEST_BYTES = 1 << 30


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
    #: the features a reader needs beyond the core schema (docs/format.md 10), as read;
    #: ``dumps`` derives them from what it writes and sets them
    requires: tuple[str, ...] = ()
    #: the "encryption" member of an encrypted checkpoint's manifest (codec/crypto.py
    #: ``seal_manifest`` appends it, with its MAC, after ``dumps``); None: not encrypted
    encryption: dict[str, Any] | None = None
    #: the optional "logical" member: each tensor leaf's logical digest (format/logical_member.py)
    logical: dict[str, Any] | None = None

    #: the one format_version (format/features.py): a manifest of another is never read
    format_version = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The manifest's members, but for ``requires`` (``dumps`` adds it) and ``encryption``
        (sealing appends it)."""
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "created_at": self.created_at,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "digest_algorithm": self.digest_algorithm,
            "digest_block_bytes": self.digest_block_bytes,
            "per_rank_prefixes": list(self.per_rank_prefixes),
            "metadata": self.metadata,
            "files": self.files,
            **leaves_fields(self.leaves),
            **({MEMBER: self.logical} if self.logical is not None else {}),
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

    def uses(self) -> set[str]:
        """The features the leaves use: described leaves, and their pages."""
        described = self.leaves.described if isinstance(self.leaves, TableLeaves) else None
        if described is None:
            return set()
        return {DESCRIBED, PAGES} if described.pages is not None else {DESCRIBED}

    def dumps(self, *, sealed: bool = False) -> bytes:
        """The manifest's bytes, ``requires`` naming exactly the features they use (``sealed``:
        the bytes will be sealed, codec/crypto_manifest.py ``seal_manifest``, so they require
        encryption). Values that standard JSON or a fast parser would not give back exactly
        (NaN, infinities, integers beyond 64 bits) are written in the extended form
        (format/jsonvalue.py), which the manifest then requires; a value that cannot come
        back at all (a lone surrogate, a non-string key) raises ``ValueError``."""
        extended = False
        for key, value in self.object_values().items():
            try:
                extended |= check_value(value)
            except JsonValueError as e:
                raise ValueError(describe_problem(key, e)) from None
        uses = self.uses() | ({ENCRYPTION} if sealed else set()) | ({EXTENDED_JSON} if extended else set())
        self.requires = tuple(sorted(uses))
        body = self.to_json()
        d = {
            "format_version": body.pop("format_version"),
            **({"requires": list(self.requires)} if uses else {}),
            **body,
        }
        if extended:
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
        with no_gc():  # millions of small lists, no cycles: see columns.no_gc
            return cls._loads(data, where)

    @classmethod
    def _loads(cls, data: bytes, where: str) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(too_large(where, len(data)))
        try:
            # NaN, infinities and big integers only where declared (jsonvalue.py)
            d = loads_untrusted(data, max_bytes=MAX_MANIFEST_BYTES, exact=declares_extended)
        except UntrustedJSONError as e:
            raise CorruptCheckpointError(
                f"manifest {where} {e}; the checkpoint is damaged: restore another step, or run "
                f"`shardkeeper verify` on the root"
            ) from None
        requires = check_envelope(d, where)
        try:
            m = cls(
                step=d["step"],
                world_size=d["world_size"],
                leaves=read_leaves(d),
                files=d["files"],
                digest_algorithm=d["digest_algorithm"],
                digest_block_bytes=d["digest_block_bytes"],
                per_rank_prefixes=tuple(d.get("per_rank_prefixes", [])),
                metadata=d.get("metadata", {}),
                created_at=d.get("created_at", ""),
                attempt=d.get("attempt", ""),
                requires=requires,
                encryption=d.get("encryption"),
                logical=member_of(d),  # null: refused by problem()
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
                f"manifest {where} is inconsistent: {problem}; the checkpoint is damaged: restore another step"
            )
        return m

    def problem(self) -> str | None:
        """Why this manifest cannot be trusted, or None: what restore relies on, checked once
        (types, sizes, digest counts, paths), so later reads need no per-field checks
        (``manifest_checks.manifest_problem``)."""
        why = manifest_problem(self)
        return why if why is not None or self.logical is None else member_problem(self.logical, self.leaves)

    def chunks(self) -> Iterator[tuple[str, ChunkRecord]]:
        for key, leaf in self.leaves.items():
            for c in leaf.chunks:
                yield key, c

    @property
    def pages(self) -> Pages | None:
        """The pages holding the ranks' records (docs/format.md 3.9), or None."""
        described = self.leaves.described if isinstance(self.leaves, TableLeaves) else None
        return described.pages if described is not None else None

    def every_file(
        self, on_damage: Callable[[str, CorruptCheckpointError], None] | None = None
    ) -> dict[str, dict[str, Any]]:
        """``files`` and, with pages, every page's files (reads every page; ``on_damage``:
        ``Pages.files``')."""
        pages = self.pages
        return self.files if pages is None else {**pages.files(on_damage), **self.files}

    def stored(self) -> tuple[int, int]:
        """How many files this step's manifest (and its pages) list, and their bytes, without
        reading a page (each page's entry counts its files)."""
        n = len(self.files)
        total = sum(int(f.get("size_bytes", 0)) for f in self.files.values() if isinstance(f, dict))
        pages = self.pages
        if pages is not None:
            n, total = n + sum(pages.nfiles), total + sum(pages.nbytes)
        return n, total

    def chunk_file_ends(self, *, pages: bool = True) -> dict[str, int]:
        """Every file (relative to the step directory) a chunk lies in, with the end of the
        last chunk byte in it; for described leaves from the manifest (and, unless ``pages``
        is False, its pages), their index files unread (``verify`` without the key, the
        commit's checks: ``pages=False``, which the leaders checked)."""
        ends: dict[str, int] = {}
        described = None
        if isinstance(self.leaves, TableLeaves):  # the leaves' rows of the chunk table, as columns
            described, t = self.leaves.described, self.leaves.table
            paths, file, offset, length = t.paths, t.file, t.offset, t.length
            for i in self.leaves.leaf_table.rows:
                rel, end = paths[file[i]], offset[i] + length[i]
                if end > ends.get(rel, -1):
                    ends[rel] = end
        else:
            for leaf in self.leaves.values():
                for c in leaf.chunks:
                    ends[c.file] = max(ends.get(c.file, 0), c.offset + c.length)
        if described is not None:
            more = described.file_ends() if pages or described.pages is None else {}
            for rel, end in more.items():
                ends[rel] = max(ends.get(rel, 0), end)
        return ends

    def referenced_files(self) -> set[str]:
        """Files (relative to the step directory) this manifest's chunks point at."""
        out = set(self.every_file())
        if isinstance(self.leaves, TableLeaves):
            more = self.leaves.described.file_ends() if self.leaves.described is not None else {}
            return out | set(self.leaves.table.paths) | set(more)
        out.update(c.file for _, c in self.chunks())
        return out

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def too_large(where: str, size: int) -> str:
    return (
        f"manifest {where} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a reader accepts; "
        f"it is damaged or not a shardkeeper manifest: restore another step"
    )


__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "BlockDigests",
    "ChunkRecord",
    "LazyLeaves",
    "LeafRecord",
    "Manifest",
    "check_tiling",
    "check_tiling_boxes",
    "encoded_length_problem",
    "itemsize",
    "safe_relative_path",
    "too_large",
]
