"""Chunk digests, computed while bytes stream out and checked on exactly the bytes read.

A chunk's stored bytes are digested in fixed-size blocks (``block_bytes``, recorded in the
manifest) so that a ranged read of part of a chunk can be verified without reading the rest:
a reader widens its range to block boundaries and checks every block it read.

``xxh3_128`` is the default: non-cryptographic, over 10 GB/s per core, so it never limits a
save. ``sha256`` is there where a cryptographic digest is required (about 1.5-2 GB/s).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import xxhash

DEFAULT_ALGORITHM = "xxh3_128"
DEFAULT_BLOCK_BYTES = 64 << 10


def _sha256(data: memoryview | bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_ALGORITHMS: dict[str, Callable[[memoryview | bytes], str]] = {
    "xxh3_128": xxhash.xxh3_128_hexdigest,  # itself, not wrapped: one call per small chunk
    "sha256": _sha256,
}


def algorithms() -> tuple[str, ...]:
    return tuple(_ALGORITHMS)


def digest_function(name: str) -> Callable[[memoryview | bytes], str]:
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown digest algorithm {name!r}; choose one of {', '.join(_ALGORITHMS)}") from None


def block_digests(data: memoryview, algorithm: str, block_bytes: int) -> list[str]:
    """Digest ``data`` in ``block_bytes`` blocks (the last may be shorter; empty data has none)."""
    fn = digest_function(algorithm)
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    n = len(view)
    return [fn(view[i : i + block_bytes]) for i in range(0, n, block_bytes)]


def block_span(start: int, end: int, block_bytes: int, length: int) -> tuple[int, int]:
    """Widen the byte range ``[start, end)`` of a chunk to whole digest blocks."""
    lo = (start // block_bytes) * block_bytes
    hi = min(length, -(-end // block_bytes) * block_bytes)
    return lo, hi


__all__ = [
    "DEFAULT_ALGORITHM",
    "DEFAULT_BLOCK_BYTES",
    "algorithms",
    "block_digests",
    "block_span",
    "digest_function",
]
