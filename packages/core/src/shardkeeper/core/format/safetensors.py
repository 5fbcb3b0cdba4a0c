"""Shard files in the safetensors layout: 8-byte little-endian header length, a JSON header,
then the tensors' bytes back to back. Any safetensors reader can open an unencoded shard.

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


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for ``(name, dtype, shape, nbytes)`` entries.

    Returns the header and each entry's absolute byte offset in the file.
    """
    align = PAGE_ALIGN if data_on_a_page(sum(e[3] for e in entries)) else _ALIGN
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    pos = 0
    rel = []
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": DTYPES[dtype][0],
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        rel.append(pos)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw) - 8) % align)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, [len(prefix) + r for r in rel]


def chunk_name(key: str, offsets: Sequence[int], shape: Sequence[int], global_shape: Sequence[int]) -> str:
    """A readable, unique tensor name for a chunk: ``key`` if whole, else ``key[a:b,c:d]``."""
    if list(offsets) == [0] * len(offsets) and list(shape) == list(global_shape):
        return key
    return key + "[" + ",".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) + "]"
