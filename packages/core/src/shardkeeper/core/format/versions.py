"""What each format_version introduced: the numbers the writer, the reader and the checks
of untrusted manifests compare against.

Layering: a leaf module (it imports nothing), so that the records, the tables, the checks
and the manifest itself can all name a version without importing one another.
"""

from __future__ import annotations

#: The format_version this code writes (2 added chunk encodings; a version 1 manifest reads
#: exactly as before), unless the manifest needs a later one (``EXTENDED_JSON_VERSION``).
FORMAT_VERSION = 5  # 3: the chunk table (TABLE_VERSION); 4: encryption; 5: the leaf table
#: The format_version that stores chunk records as columns (format/columns.py ``ChunkTable``).
TABLE_VERSION = 3
#: The format_version that introduced encrypted data files and the manifest's "encryption"
#: member (docs/format.md 4.2): a reader of version 3 would take ciphertext for damage.
ENCRYPTION_VERSION = 4
#: The format_version that stores tensor and bytes leaves as columns too (``LeafTable``).
LEAF_TABLE_VERSION = 5
#: The format_version that introduced extended JSON values (format/jsonvalue.py): NaN,
#: infinities and integers beyond 64 bits in metadata and object leaves, declared by the
#: top-level ``extended_json`` member. Written only by manifests that hold such a value, so
#: that every other checkpoint stays readable by readers of version 5.
EXTENDED_JSON_VERSION = 6
#: The format_version whose encrypted checkpoints are bound to their root (codec/crypto.py):
#: the manifest's encryption member names the root, and data files authenticate it.
ROOT_BOUND_VERSION = 6
#: The format_version of described leaves (format/described.py): chunks that follow a
#: rule, kept in per-rank index files. Written only by manifests that hold such leaves.
DESCRIBED_VERSION = 7
#: The format_version of pages (format/pages.py): the ranks' records (files, index entries)
#: in one file per group of ranks. Written only by group commits of described leaves.
PAGED_VERSION = 8
#: The newest format_version this code reads.
READ_VERSION = 8
#: Chunk encodings and the format_version that introduced each (docs/codecs.md).
ENCODINGS: dict[str, int] = {"raw": 1, "zstd": 2, "shuffle-zstd": 2}


__all__ = [
    "DESCRIBED_VERSION",
    "ENCODINGS",
    "ENCRYPTION_VERSION",
    "EXTENDED_JSON_VERSION",
    "FORMAT_VERSION",
    "LEAF_TABLE_VERSION",
    "PAGED_VERSION",
    "READ_VERSION",
    "ROOT_BOUND_VERSION",
    "TABLE_VERSION",
]
