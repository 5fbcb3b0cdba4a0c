"""What a step's stored bytes can back: the bounds that keep a hostile manifest from turning
into an allocation its files cannot fill (docs/format.md 3.3.1 and 12).

A raw chunk's stored bytes are its box's bytes, so its box can be no larger than its range
of a file. An encoded chunk is one zstd frame (RFC 8878), and a frame cannot expand without
limit: every block decodes to at most ``Block_Maximum_Size`` = 128 KiB, and the cheapest
block that decodes to anything is an RLE block of 4 bytes (a 3-byte block header, then the
byte to repeat); compressed blocks cost at least 5 bytes, raw ones 3 plus their content, an
empty block 3. Before its blocks a frame has its 4-byte magic number and a frame header of
at least 2 bytes. So ``L`` stored bytes decode to at most ``128 KiB * (L - 6) / 4 =
32768 * (L - 6)`` bytes (``max_decoded_bytes``); the reader refuses an encoded chunk whose box
is larger before it reads anything (``Manifest.problem``).

Chunks of one leaf never share stored bytes (a writer stores each box once; an incremental
reference names another step's copy of the same box), so a leaf's chunks together cannot
claim more stored bytes than their files hold: ``stored_bytes_problem`` checks that, with the
files' real sizes, before a reader allocates a leaf that no target sizes (a bytes leaf, an
export).

Ranks: a manifest's ``world_size`` is at most ``MAX_WORLD_SIZE``, and a page (format.md 3.9)
lists at least ``PAGE_BYTES_PER_RANK`` bytes per rank it claims (``null``, ``0`` and ``""``
with their commas, the shortest index entry), so a page of ``L`` bytes holds at most
``L // 10`` ranks (``max_page_ranks``): a reader refuses a page that claims more before it
derives anything from those ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Most bytes one byte of a zstd frame decodes to: a 128 KiB block from a 4-byte RLE block.
ZSTD_MAX_EXPANSION = 32768
#: The smallest zstd frame before its blocks: the magic number (4) and a frame header (2).
ZSTD_FRAME_MIN_BYTES = 6
#: Most ranks a manifest's world may have (a few bytes of ``world_size`` must not stand for
#: more ranks than any job runs, each one a cell the reader might derive).
MAX_WORLD_SIZE = 1 << 20
#: The fewest bytes a page spends on each of its ranks: an index entry of ``null``, ``0`` and
#: ``""``, each followed by a comma (every other entry is longer).
PAGE_BYTES_PER_RANK = 10


def max_decoded_bytes(length: int) -> int:
    """The most bytes one zstd frame of ``length`` stored bytes can decode to."""
    return ZSTD_MAX_EXPANSION * max(0, length - ZSTD_FRAME_MIN_BYTES)


def max_page_ranks(size: int) -> int:
    """The most ranks a page of ``size`` bytes can list."""
    return max(0, size) // PAGE_BYTES_PER_RANK


def stored_bytes_problem(chunks: Sequence[Any], size_of: Callable[[str], int | None]) -> str | None:
    """Why the stored bytes of one leaf's ``chunks`` (chunk records) cannot all be in their
    files, or None. ``size_of(file)`` is the real size of a chunk's file (None: missing),
    asked once a file: every chunk must lie inside its file, and the chunks' lengths must add
    up to no more than their files hold together."""
    sizes: dict[str, int] = {}
    for c in chunks:
        size = sizes.get(c.file)
        if size is None:
            found = size_of(c.file)
            if found is None:
                return f"its file {c.file!r} is missing"
            size = sizes[c.file] = found
        if c.offset + c.length > size:
            return f"its file {c.file!r} is {size} bytes, shorter than the {c.offset + c.length} a chunk needs"
    stored = sum(c.length for c in chunks)
    held = sum(sizes.values())
    if stored > held:
        return (
            f"its {len(chunks)} chunks claim {stored} stored bytes, more than the {held} their "
            f"{len(sizes)} file(s) hold: chunks share stored bytes, which no writer does"
        )
    return None


__all__ = [
    "MAX_WORLD_SIZE",
    "PAGE_BYTES_PER_RANK",
    "ZSTD_FRAME_MIN_BYTES",
    "ZSTD_MAX_EXPANSION",
    "max_decoded_bytes",
    "max_page_ranks",
    "stored_bytes_problem",
]
