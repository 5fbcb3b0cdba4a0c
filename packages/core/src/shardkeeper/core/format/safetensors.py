"""Shard files in the safetensors layout: 8-byte little-endian header length, a JSON header,
then the tensors' bytes back to back (large ones on 64 bytes, the gaps declared as padding
entries: ``ITEM_ALIGN``). Any safetensors reader can open an unencoded shard.

The header is padded with spaces to a multiple of 8 bytes so that tensor data starts aligned;
for files with at least ``PAGE_ALIGN_MIN_BYTES`` of data (``data_on_a_page``), to a multiple
of 4 KiB, so that the data section starts on a page: local storage then writes it with
``O_DIRECT`` straight from the page-aligned staging buffer (docs/decisions.md D19).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from shardkeeper.core.format.manifest import DTYPES

_ALIGN = 8
PAGE_ALIGN = 4096
PAGE_ALIGN_MIN_BYTES = 1 << 20


def data_on_a_page(nbytes: int) -> bool:
    """Whether a shard file with ``nbytes`` of tensor data gets its data section on a page
    (its header padded to ``PAGE_ALIGN``); the stager places such a file's bytes on a page of
    its buffer by the same rule."""
    return nbytes >= PAGE_ALIGN_MIN_BYTES


#: The first 8 bytes of a framed shard file (one holding encoded chunks, docs/codecs.md):
#: the chunks' stored bytes follow back to back, described by the manifest alone. Read as a
#: safetensors header length it is absurdly large, so safetensors readers refuse the file.
FRAMED_MAGIC = b"SKFRAMED"


#: In shard files written by a save (``align_items``), each tensor of at least
#: ``ITEM_ALIGN_MIN_BYTES`` starts on a multiple of ``ITEM_ALIGN`` bytes of the data section,
#: and so does its place in the staging buffer, which mirrors the data section: the staging
#: copy then has source and destination equally aligned (torch allocates on 64 bytes), which
#: made the copy of a 256 MiB state 20 % faster, and of 10,000 tensors of 1-8 KiB 15 % faster
#: (docs/decisions.md D20). Safetensors allows no holes, so
#: each gap (under 64 bytes, zeros) is declared as a uint8 tensor named ``PAD_PREFIX`` + its
#: offset; readers of the manifest never look at it.
ITEM_ALIGN = 64
ITEM_ALIGN_MIN_BYTES = 4 << 10
PAD_PREFIX = "__shardkeeper_pad__"


def data_offsets(sizes: Sequence[int], *, align_items: bool) -> tuple[list[int], int]:
    """Each item's offset in a data section of items of ``sizes`` bytes, in order, and the
    section's length (see ``ITEM_ALIGN``)."""
    pos = 0
    out = []
    for n in sizes:
        if align_items and n >= ITEM_ALIGN_MIN_BYTES:
            pos = -(-pos // ITEM_ALIGN) * ITEM_ALIGN
        out.append(pos)
        pos += n
    return out, pos


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: dict[str, str] | None = None,
    *,
    align_items: bool = False,
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for ``(name, dtype, shape, nbytes)`` entries,
    back to back, or with large ones on ``ITEM_ALIGN`` (``align_items``, padding declared).

    Returns the header and each entry's absolute byte offset in the file.
    """
    rel, end = data_offsets([e[3] for e in entries], align_items=align_items)
    align = PAGE_ALIGN if data_on_a_page(end) else _ALIGN
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    pos = 0
    for (name, dtype, shape, nbytes), at in zip(entries, rel):
        if at > pos:
            header[f"{PAD_PREFIX}{pos}"] = {"dtype": "U8", "shape": [at - pos], "data_offsets": [pos, at]}
        header[name] = {
            "dtype": DTYPES[dtype][0],
            "shape": list(shape),
            "data_offsets": [at, at + nbytes],
        }
        pos = at + nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw) - 8) % align)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, [len(prefix) + r for r in rel]


def chunk_name(key: str, offsets: Sequence[int], shape: Sequence[int], global_shape: Sequence[int]) -> str:
    """A readable, unique tensor name for a chunk: ``key`` if whole, else ``key[a:b,c:d]``."""
    if list(offsets) == [0] * len(offsets) and list(shape) == list(global_shape):
        return key
    return key + "[" + ",".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) + "]"


__all__ = [
    "FRAMED_MAGIC",
    "ITEM_ALIGN",
    "ITEM_ALIGN_MIN_BYTES",
    "PAD_PREFIX",
    "PAGE_ALIGN",
    "PAGE_ALIGN_MIN_BYTES",
    "build_header",
    "chunk_name",
    "data_offsets",
    "data_on_a_page",
]
