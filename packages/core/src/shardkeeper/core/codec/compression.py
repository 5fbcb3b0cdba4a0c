"""zstd compression of chunks, decided per chunk by compressing a sample first.

Encoding ``zstd``: a chunk's stored bytes are one zstd frame (with its content size) of the
chunk's raw row-major bytes. Digests cover the stored (compressed) bytes, so ``verify``
checks a compressed checkpoint without decompressing it. A compressed chunk is read whole
on restore (a frame cannot be entered in the middle).

The ``zstandard`` package is an extra: ``pip install 'shardkeeper-core[zstd]'``; it is
imported only when compression is on or a compressed chunk is read.
"""

from __future__ import annotations

import threading
from typing import Any

ENCODING = "zstd"
ENCODINGS = ("raw", ENCODING)
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


def _sample(data: memoryview) -> memoryview | bytes:
    n = len(data)
    if n <= SAMPLE_BYTES:
        return data
    part = SAMPLE_BYTES // SAMPLE_SLICES
    stride = (n - part) // (SAMPLE_SLICES - 1)
    return b"".join(data[i * stride : i * stride + part] for i in range(SAMPLE_SLICES))


def precheck(data: memoryview, level: int) -> bytes | bool:
    """Is compressing this chunk worth trying? Small chunks: False. Chunks no larger than the
    sample: their frame if it pays (already computed), else False. Larger ones: whether the
    sample shrank below KEEP_RAW_RATIO (the whole chunk is compressed later, by
    ``compress_if_pays``). The writer asks before it writes a file's first byte, so a file
    whose chunks all stay raw remains a plain safetensors file."""
    n = len(data)
    if n < MIN_COMPRESS_BYTES:
        return False
    if n <= SAMPLE_BYTES:
        frame = compress_if_pays(data, level)
        return False if frame is None else frame
    sample = _sample(data)
    return len(_compressor(level).compress(sample)) <= KEEP_RAW_RATIO * len(sample)


def compress_if_pays(data: memoryview, level: int) -> bytes | None:
    """The chunk's zstd frame, or None when it is no smaller than KEEP_RAW_RATIO x raw."""
    out: bytes = _compressor(level).compress(data)
    return out if len(out) <= KEEP_RAW_RATIO * len(data) else None


def maybe_compress(data: memoryview, level: int) -> bytes | None:
    """The chunk's zstd frame, or None when it should stay raw (small, or does not pay)."""
    pre = precheck(data, level)
    if isinstance(pre, bytes) or not pre:
        return pre or None
    return compress_if_pays(data, level)


def decompress_into(stored: memoryview | bytes, out: memoryview, where: str) -> None:
    """Decode one zstd frame into ``out``, which must be exactly its decoded size."""
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
            f"{where}: the zstd frame decodes to {len(data)} bytes, the chunk needs {len(out)}; "
            f"restore an earlier step"
        )
    out[:] = data
