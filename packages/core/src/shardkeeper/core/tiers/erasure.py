"""Erasure codes over a group of k files (one per node): m parity files, from which any m
lost files are rebuilt with the group's k surviving files. Torch-free: numpy, and zfec for m >= 2.

The k data files may differ in length: each is padded virtually with zeros to the longest,
rounded up to 8 bytes (the parity files' length, ``parity_length``). Their lengths are kept
beside the parity (the caller records them), so that a rebuilt file is cut back to its own.
m = 1 is plain XOR over uint64 words; m >= 2 is zfec's systematic Reed-Solomon code over
GF(2^8) (the ``erasure`` extra: ``pip install 'shardkeeper-core[erasure]'``). Both stream the
files in pieces of ``piece_bytes``: memory is about (k + m) pieces, whatever the files' sizes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import xxhash

from shardkeeper.core.errors import TooManyLost

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: The piece of each file coded at once (a multiple of 8).
PIECE_BYTES = 4 << 20
#: The codes, as recorded beside the parity: a reader rebuilds only with the same one.
XOR, RS = "xor", "zfec-rs"
#: zfec's largest k + m (GF(2^8)).
MAX_SHARDS = 256

#: ``read(offset, buffer)``: fill ``buffer`` with the file's bytes at ``offset``.
Read = Callable[[int, memoryview], None]
#: ``write(data)``: append ``data`` to a file being written.
Write = Callable[[memoryview], object]


def check_code(k: Any, m: Any) -> tuple[int, int]:
    """``erasure=(k, m)`` checked: integers, k >= 1, m >= 1, k + m <= 256."""
    for name, v in (("k", k), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"erasure=(k, m): {name} must be an int, got {v!r}; pass e.g. erasure=(4, 1)")
    if k < 1:
        raise ValueError(f"erasure=(k, m): k={k}, but a group needs at least 1 data node; pass k >= 1")
    if m < 1:
        raise ValueError(
            f"erasure=(k, m): m={m}, but parity needs at least 1 node; pass m >= 1, or drop erasure= (no node "
            f"loss is then survived before an upload)"
        )
    if k + m > MAX_SHARDS:
        raise ValueError(f"erasure=(k, m): k + m = {k + m}, but the code allows at most {MAX_SHARDS}; lower k")
    return k, m


def _zfec() -> Any:
    try:
        zfec = importlib.import_module("zfec")
    except ImportError as e:
        raise ImportError(
            "erasure=(k, m) with m >= 2 needs zfec (Reed-Solomon): pip install 'shardkeeper-core[erasure]', "
            "or use m=1 (XOR, no extra package)"
        ) from e
    return zfec


@lru_cache(maxsize=16)
def _coder(kind: str, k: int, n: int) -> Any:
    z = _zfec()
    return z.Encoder(k, n) if kind == "enc" else z.Decoder(k, n)


def parity_length(lengths: Sequence[int]) -> int:
    """The parity files' length: the longest data file, rounded up to 8 bytes."""
    longest = max(lengths, default=0)
    return -(-longest // 8) * 8


@dataclass(frozen=True)
class Code:
    """An erasure code of ``k`` data and ``m`` parity shards; shard ``i < k`` is data file
    ``i``, shard ``k + j`` parity file ``j``."""

    k: int
    m: int

    def __post_init__(self) -> None:
        check_code(self.k, self.m)
        if self.m > 1:
            _zfec()  # (the error names the extra before any byte is coded)

    @property
    def name(self) -> str:
        return XOR if self.m == 1 else RS

    def encode(self, blocks: Sequence[np.ndarray], shards: Sequence[int] | None = None) -> list[np.ndarray]:
        """The parity blocks ``shards`` (default all m: ``0..m-1``) of ``k`` equal-length uint8
        blocks (lengths a multiple of 8)."""
        which = tuple(range(self.m)) if shards is None else tuple(shards)
        if self.m == 1:
            acc = blocks[0].view(np.uint64).copy()
            for b in blocks[1:]:
                np.bitwise_xor(acc, b.view(np.uint64), out=acc)
            return [acc.view(np.uint8) for _ in which]
        out = _coder("enc", self.k, self.k + self.m).encode(
            tuple(_view(b) for b in blocks), tuple(self.k + j for j in which)
        )
        return [np.frombuffer(p, dtype=np.uint8) for p in out]

    def decode(self, blocks: Mapping[int, np.ndarray], want: Sequence[int]) -> dict[int, np.ndarray]:
        """The data blocks ``want`` from at least ``k`` of the shards (``blocks``: shard index
        -> block, all of one length)."""
        if not want:
            return {}
        have = sorted(blocks)[: self.k]  # data shards first: zfec copies them through
        if len(have) < self.k:
            raise TooManyLost(f"{len(have)} of {self.k + self.m} shards left; {self.k} are needed")
        if self.m == 1:
            acc = blocks[have[0]].view(np.uint64).copy()
            for i in have[1:]:
                np.bitwise_xor(acc, blocks[i].view(np.uint64), out=acc)
            return {want[0]: acc.view(np.uint8)}
        out = _coder("dec", self.k, self.k + self.m).decode(tuple(_view(blocks[i]) for i in have), tuple(have))
        return {i: np.frombuffer(out[i], dtype=np.uint8) for i in want}


def _view(a: np.ndarray) -> memoryview:
    return memoryview(cast("Buffer", a))


def _fill(buf: np.ndarray, read: Read, offset: int, length: int) -> None:
    """``buf`` with the file's bytes at ``offset`` (``length``: the file's), zeros past its end."""
    n = max(0, min(len(buf), length - offset))
    if n:
        read(offset, _view(buf[:n]))
    buf[n:] = 0


def encode_files(
    code: Code,
    lengths: Sequence[int],
    readers: Sequence[Read],
    writers: Sequence[Write],
    piece_bytes: int = PIECE_BYTES,
) -> list[str]:
    """Write the m parity files of the k data files (``lengths``, ``readers``) to ``writers``,
    piece by piece; returns each parity file's xxh3-128 digest (hex). Each parity file is
    ``parity_length(lengths)`` bytes."""
    _check_piece(piece_bytes)
    if len(lengths) != code.k or len(readers) != code.k or len(writers) != code.m:
        raise ValueError(f"encode_files: {code.k} data files and {code.m} parity writers expected")
    total = parity_length(lengths)
    hashes = [xxhash.xxh3_128() for _ in range(code.m)]
    bufs = [np.empty(min(piece_bytes, total), dtype=np.uint8) for _ in range(code.k)]
    for offset in range(0, total, piece_bytes):
        n = min(piece_bytes, total - offset)
        blocks = [b[:n] for b in bufs]
        for block, read, length in zip(blocks, readers, lengths):
            _fill(block, read, offset, length)
        for parity, write, h in zip(code.encode(blocks), writers, hashes):
            h.update(_view(parity))
            write(_view(parity))
    return [h.hexdigest() for h in hashes]


def rebuild_files(
    code: Code,
    lengths: Sequence[int],
    readers: Mapping[int, Read],
    writers: Mapping[int, Write],
    piece_bytes: int = PIECE_BYTES,
) -> dict[int, str]:
    """Write the lost data files ``writers`` (data index -> writer) from the surviving shards
    ``readers`` (shard index -> reader: data ``i < k``, parity ``k + j``), piece by piece, each
    cut to its length; returns each rebuilt file's xxh3-128 digest (hex). Raises
    ``TooManyLost`` when fewer than k shards survive."""
    _check_piece(piece_bytes)
    lost = sorted(writers)
    if any(not 0 <= i < code.k for i in lost) or set(lost) & set(readers):
        raise ValueError(f"rebuild_files: the lost files {lost} must be data shards (0..{code.k - 1}) not read")
    have = sorted(readers)[: code.k]
    if len(have) < code.k and lost:
        gone = sorted(set(range(code.k + code.m)) - set(readers))
        raise TooManyLost(
            f"{len(gone)} of the group's {code.k + code.m} shards are lost (data files {[i for i in gone if i < code.k]}, "
            f"parity files {[i - code.k for i in gone if i >= code.k]}); parity m={code.m} rebuilds at most {code.m}"
        )
    total = parity_length(lengths)
    hashes = {i: xxhash.xxh3_128() for i in lost}
    bufs = {i: np.empty(min(piece_bytes, total), dtype=np.uint8) for i in have} if lost else {}
    for offset in range(0, total, piece_bytes) if lost else ():
        n = min(piece_bytes, total - offset)
        blocks = {i: bufs[i][:n] for i in have}
        for i, block in blocks.items():
            _fill(block, readers[i], offset, lengths[i] if i < code.k else total)
        for i, block in code.decode(blocks, lost).items():
            keep = max(0, min(n, lengths[i] - offset))
            if keep:
                part = _view(block[:keep])
                hashes[i].update(part)
                writers[i](part)
    return {i: h.hexdigest() for i, h in hashes.items()}


def _check_piece(piece_bytes: int) -> None:
    if piece_bytes <= 0 or piece_bytes % 8:
        raise ValueError(f"piece_bytes={piece_bytes}: pass a positive multiple of 8")


__all__ = [
    "MAX_SHARDS",
    "PIECE_BYTES",
    "RS",
    "XOR",
    "Code",
    "Read",
    "TooManyLost",
    "Write",
    "check_code",
    "encode_files",
    "parity_length",
    "rebuild_files",
]
