"""zstd compression of chunks, decided per chunk by compressing a sample first.

Encoding ``zstd``: a chunk's stored bytes are one zstd frame (with its content size) of the
chunk's raw row-major bytes; used for 1-byte dtypes. Encoding ``shuffle-zstd``: the same, of
the raw bytes *byte-shuffled* by item size first (all first bytes of the elements, then all
second bytes, ...), which puts the low-entropy sign/exponent bytes of floats side by side:
trained fp32 weights and Adam moments shrink to ~0.85 instead of ~0.92 with plain zstd.
Digests cover the stored (compressed) bytes, so ``verify`` checks a compressed checkpoint
without decompressing it. A compressed chunk is read whole on restore (a frame cannot be
entered in the middle).

The ``zstandard`` package is an extra: ``pip install 'shardkeeper-core[zstd]'``; it is
imported only when compression is on or a compressed chunk is read.
"""

from __future__ import annotations

import threading
from typing import Any

ENCODING = "zstd"
SHUFFLED = "shuffle-zstd"
ENCODINGS = ("raw", ENCODING, SHUFFLED)
COMPRESSIONS = (None, "none", ENCODING)

#: Chunks smaller than this stay raw: a frame header and a whole-chunk read cost more than
#: the bytes saved.
MIN_COMPRESS_BYTES = 4096
#: Up to this many bytes, in SAMPLE_SLICES slices spread over the chunk, are compressed first
#: to decide; chunks whose sample does not shrink below KEEP_RAW_RATIO stay raw.
SAMPLE_BYTES = 256 << 10
SAMPLE_SLICES = 4
#: compressed / raw above this: not worth a whole-chunk read and the CPU; keep raw.
KEEP_RAW_RATIO = 0.9
#: With compression on, chunks larger than this are written as slabs of whole rows of about
#: this size, one frame each (save/write.py ``_slabs``): partial reads stay partial.
SLAB_BYTES = 4 << 20

_local = threading.local()


def require_zstd() -> Any:
    """The ``zstandard`` module, or an ImportError that names the extra to install."""
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(
            "compression='zstd' (and reading zstd-compressed chunks) needs the zstandard "
            "package: pip install 'shardkeeper-core[zstd]'"
        ) from e
    return zstandard


def check_options(compression: str | None, level: int) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}; choose one of None, 'zstd'")
    if compression == ENCODING:
        zstd = require_zstd()
        lo, hi = -(1 << 17), zstd.MAX_COMPRESSION_LEVEL
        if not isinstance(level, int) or not lo <= level <= hi:
            raise ValueError(f"compression_level must be an int in [{lo}, {hi}], got {level!r}")


def _compressor(level: int) -> Any:
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = require_zstd().ZstdCompressor(level=level, write_content_size=True)
    return c


def _sample(data: memoryview, isz: int) -> memoryview | bytes:
    n = len(data)
    if n <= SAMPLE_BYTES:
        return data
    part = SAMPLE_BYTES // SAMPLE_SLICES
    stride = (n - part) // (SAMPLE_SLICES - 1) // isz * isz
    return b"".join(data[i * stride : i * stride + part] for i in range(SAMPLE_SLICES))


def shuffle(data: memoryview | bytes, isz: int) -> memoryview | bytes:
    """Byte-shuffle elements of ``isz`` bytes: byte k of every element, for k = 0 .. isz-1."""
    if isz == 1:
        return data
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8).reshape(-1, isz).T.tobytes()


def unshuffle_into(data: bytes, out: memoryview, isz: int) -> None:
    """The inverse of ``shuffle``, written into ``out``."""
    import numpy as np

    if isz == 1:
        out[:] = data
        return
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, isz)
    dst[...] = np.frombuffer(data, dtype=np.uint8).reshape(isz, -1).T


def encoding_for(isz: int) -> str:
    return SHUFFLED if isz > 1 else ENCODING


def precheck(data: memoryview, level: int, isz: int = 1) -> bytes | bool:
    """Is compressing this chunk (elements of ``isz`` bytes) worth trying? Small chunks:
    False. Chunks no larger than the sample: their frame if it pays (already computed), else
    False. Larger ones: whether the sample shrank below KEEP_RAW_RATIO (the whole chunk is
    compressed later, by ``compress_if_pays``). The writer asks before it writes a file's
    first byte, so a file whose chunks all stay raw remains a plain safetensors file. The
    encoding of a frame is ``encoding_for(isz)``."""
    n = len(data)
    if n < MIN_COMPRESS_BYTES or n % isz:
        return False
    if n <= SAMPLE_BYTES:
        frame = compress_if_pays(data, level, isz)
        return False if frame is None else frame
    sample = shuffle(_sample(data, isz), isz)
    return len(_compressor(level).compress(sample)) <= KEEP_RAW_RATIO * len(sample)


def compress_if_pays(data: memoryview, level: int, isz: int = 1) -> bytes | None:
    """The chunk's frame (``encoding_for(isz)``), or None when it is no smaller than
    KEEP_RAW_RATIO x raw."""
    out: bytes = _compressor(level).compress(shuffle(data, isz))
    return out if len(out) <= KEEP_RAW_RATIO * len(data) else None


def maybe_compress(data: memoryview, level: int, isz: int = 1) -> bytes | None:
    """The chunk's frame, or None when it should stay raw (small, or does not pay)."""
    pre = precheck(data, level, isz)
    if isinstance(pre, bytes) or not pre:
        return pre or None
    return compress_if_pays(data, level, isz)


def decompress_into(stored: memoryview | bytes, out: memoryview, where: str, isz: int = 1) -> None:
    """Decode one frame into ``out``, which must be exactly its decoded size; ``isz`` > 1
    undoes the byte shuffle of ``shuffle-zstd``."""
    from shardkeeper.core.errors import CorruptCheckpointError

    zstd = require_zstd()
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstd.ZstdDecompressor()
    try:
        # The frame's own size claim is checked before anything is allocated.
        size = zstd.frame_content_size(stored)
        if size != len(out):
            raise CorruptCheckpointError(
                f"{where}: the zstd frame says it holds {size} bytes, the chunk needs {len(out)}; "
                f"restore an earlier step"
            )
        data = d.decompress(stored)
    except zstd.ZstdError as e:
        raise CorruptCheckpointError(
            f"{where}: the zstd frame does not decode ({e}) although its digests match: the "
            f"writer was broken; restore an earlier step"
        ) from e
    if len(data) != len(out):
        raise CorruptCheckpointError(
            f"{where}: the zstd frame decodes to {len(data)} bytes, the chunk needs {len(out)}; restore an earlier step"
        )
    unshuffle_into(data, out, isz)


__all__ = [
    "COMPRESSIONS",
    "ENCODING",
    "ENCODINGS",
    "KEEP_RAW_RATIO",
    "MIN_COMPRESS_BYTES",
    "SAMPLE_BYTES",
    "SAMPLE_SLICES",
    "SHUFFLED",
    "SLAB_BYTES",
    "check_options",
    "compress_if_pays",
    "decompress_into",
    "encoding_for",
    "maybe_compress",
    "precheck",
    "require_zstd",
    "shuffle",
    "unshuffle_into",
]
