"""The format's one version and the features a manifest may require (docs/format.md 10).

Every writer writes ``FORMAT_VERSION``; a reader refuses any other. What a step needs beyond
the core schema is named in the manifest's ``requires``: a reader refuses a step that
requires a feature it does not know, and ignores top-level fields it does not know.

Layering: a leaf module (it imports nothing), so that the records, the tables, the checks
and the manifest itself can all name a feature without importing one another.
"""

from __future__ import annotations

#: The format_version every writer writes and the only one a reader reads.
FORMAT_VERSION = 1
#: Encrypted data files and the manifest's ``encryption`` member, bound to its root
#: (docs/format.md 4.2).
ENCRYPTION = "encryption"
#: Values standard JSON cannot hold exactly (NaN, infinities, integers beyond 64 bits) in
#: metadata and object leaves (format/jsonvalue.py; docs/format.md 3).
EXTENDED_JSON = "extended-json"
#: Leaves recorded by their layout rule, their chunks in per-rank index files, in the
#: ``described`` member (format/described.py; docs/format.md 3.8).
DESCRIBED = "described"
#: The ranks' records of described leaves in pages, ``described.pages`` (format/pages.py;
#: docs/format.md 3.9); only with ``DESCRIBED``.
PAGES = "pages"
#: Every feature this code reads: what a manifest's ``requires`` may name.
FEATURES = frozenset({DESCRIBED, ENCRYPTION, EXTENDED_JSON, PAGES})
#: The chunk encodings of the core schema (docs/codecs.md): every reader decodes them.
ENCODINGS = frozenset({"raw", "zstd", "shuffle-zstd"})


__all__ = [
    "DESCRIBED",
    "ENCODINGS",
    "ENCRYPTION",
    "EXTENDED_JSON",
    "FEATURES",
    "FORMAT_VERSION",
    "PAGES",
]
