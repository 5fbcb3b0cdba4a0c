"""Reading a chunk's stored bytes, without torch: ranged reads, digests checked block by
block, decoding.

Restore (``restore/fill.py``), ``export.py`` and ``verify/step.py`` read chunks through
this module, so a chunk is checked the same way wherever it is read: every digest block
(format.md 3.3) of the stored bytes read is compared with the manifest's before any of them
is used, and an encoded chunk is decoded (``codec/compression.py``) only once its stored
bytes passed. Decryption happens below, in the storage (``codec/crypto.py``: an encrypted
storage checks each block's tag as it reads); a failed tag is raised here, naming the step
and the keys. Only numpy and bytes: an operator's machine without torch verifies and exports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StorageError,
)
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.manifest import ChunkRecord, Manifest
from shardkeeper.core.storage.base import Storage

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: A zstd frame header is at most 18 bytes (magic, descriptor, window, dictionary id, size).
FRAME_HEADER_BYTES = 18


class Mismatch(NamedTuple):
    """A digest block whose stored bytes do not have the recorded digest."""

    block: int  # its index in the chunk
    start: int  # its file bytes [start, end)
    end: int
    expected: str  # "<none>": the manifest records no digest for it
    found: str


def mismatches(
    digest: Callable[[memoryview | bytes], str], chunk: ChunkRecord, first_block: int, data: memoryview, block: int
) -> Iterator[Mismatch]:
    """Every digest block of ``data`` (the chunk's stored bytes from the start of its block
    ``first_block``) whose digest is not the one ``chunk`` records."""
    digests = chunk.digests
    count = len(digests)
    for i in range(0, len(data), block):
        idx = first_block + i // block
        got = digest(data[i : i + block])
        want = digests[idx] if idx < count else "<none>"
        if got != want:
            start = chunk.offset + idx * block
            yield Mismatch(idx, start, chunk.offset + min((idx + 1) * block, chunk.length), want, got)


@dataclass(frozen=True, slots=True)
class Window:
    """One read of ``ChunkReader.scan``: file bytes [start, end) of a chunk."""

    start: int
    end: int
    data: memoryview | None  # None: the read failed with ``error``
    error: CheckpointError | None
    bad: list[Mismatch]


def size_or_none(storage: Storage, path: str) -> int | None:
    """The file's size, None if it is missing (a storage failure is raised: maybe transient)."""
    try:
        return storage.size(path)
    except CheckpointNotFoundError:
        return None


def _naming(err: CorruptCheckpointError, path: str) -> CorruptCheckpointError:
    """``err`` naming ``path`` as the damaged file (a restore's quarantine verifies it)."""
    err.file = path
    return err


def frame_problem(encoding: str, head: bytes, raw_bytes: int) -> str | None:
    """What is wrong with an encoded chunk's first bytes, or None. For ``zstd``: the frame's
    declared content size must be the box's byte size (the frame is not decoded; without the
    zstandard package there is nothing to check)."""
    if encoding not in ("zstd", "shuffle-zstd"):
        return f"unknown encoding {encoding!r}"
    try:
        import zstandard
    except ImportError:
        return None
    try:
        size = zstandard.frame_content_size(head)
    except zstandard.ZstdError as e:
        return f"not a zstd frame ({e})"
    if size != raw_bytes:
        return f"the zstd frame declares {size} bytes"
    return None


@dataclass(frozen=True)
class ChunkReader:
    """Reads and checks chunks of one step; every problem is raised as an error that names
    the step (``where``), the key, the file and the byte range, and ends with ``remedy``.
    Holds no buffer: one reader serves every thread of a restore."""

    storage: Storage
    digest: Callable[[memoryview | bytes], str]
    block: int  # digest block bytes
    where: str  # how messages name the step: "step 3", "step 3 under file:///run"
    remedy: str  # what to do about damaged bytes, e.g. "export another step and run ..."
    #: False for a source that records no digests (a Hugging Face safetensors folder, hf/):
    #: its bytes are used as read, ``check`` passes them
    verify: bool = True

    @classmethod
    def of(cls, storage: Storage, manifest: Manifest, *, where: str, remedy: str, verify: bool = True) -> ChunkReader:
        """A reader of ``manifest``'s step (its digest algorithm and block size)."""
        fn = digest_function(manifest.digest_algorithm)
        return cls(storage, fn, manifest.digest_block_bytes, where, remedy, verify)

    def read(self, path: str, offset: int, buffer: memoryview, keys: Sequence[str]) -> None:
        """Fill ``buffer`` with the file bytes at ``offset``: a failure names ``keys`` and says
        whether the checkpoint is damaged (a missing or short file, a failed tag) or the
        storage failed (the file is whole in size: maybe transient)."""
        storage = self.storage
        what = f"keys {', '.join(repr(k) for k in keys[:4])}{' ...' if len(keys) > 4 else ''}"
        try:
            storage.read_into(path, offset, buffer)
        except ChecksumMismatchError as e:  # an encrypted block failed authentication (codec/crypto.py)
            raise ChecksumMismatchError(f"{self.where}, {what}: {e}", key=keys[0] if keys else "", file=path) from e
        except CorruptCheckpointError as e:  # the entry is not what the format says (a FIFO, a symlink loop...)
            raise _naming(CorruptCheckpointError(f"{self.where}, {what}: {e}"), path) from e
        except (CheckpointNotFoundError, StorageError) as e:
            where = (
                f"{self.where}: cannot read bytes [{offset}, {offset + len(buffer)}) of "
                f"{storage.describe(path)} for {what}: {e}"
            )
            if self.missing_or_short(path, offset + len(buffer)):
                raise _naming(
                    CorruptCheckpointError(
                        f"{where}. The file is missing or shorter than the manifest says: the checkpoint "
                        f"is damaged. {self.remedy[:1].upper()}{self.remedy[1:]}"
                    ),
                    path,
                ) from e
            raise StorageError(
                f"{where}. The file is there, whole in size: the storage failed (after its retries)"
            ) from e

    def missing_or_short(self, path: str, end: int) -> bool:
        """After a failed read: is the file gone or shorter than ``end`` (damage), or did the
        storage fail (possibly transient)?"""
        try:
            return self.storage.size(path) < end
        except CheckpointNotFoundError:
            return True
        except StorageError:
            return False

    def check(self, path: str, chunk: ChunkRecord, first_block: int, data: memoryview, key: str) -> None:
        """Raise ``ChecksumMismatchError`` at the first block of ``data`` (the stored bytes of
        ``chunk`` of ``key`` from its block ``first_block`` on, read from ``path``) whose digest
        is not the recorded one (nothing to check where the source records no digests)."""
        if not self.verify:
            return
        for bad in mismatches(self.digest, chunk, first_block, data, self.block):
            raise ChecksumMismatchError(
                f"checksum mismatch in {self.storage.describe(path)} at bytes [{bad.start}, {bad.end}) "
                f"of key {key!r}, {self.where}: expected {bad.expected}, read {bad.found}. The stored "
                f"bytes are damaged: {self.remedy}",
                key=key,
                file=path,
            )

    def decode(self, path: str, chunk: ChunkRecord, stored: memoryview, out: memoryview, key: str, isz: int) -> None:
        """Decode a verified encoded chunk's stored bytes into ``out`` (its raw bytes, exactly;
        ``isz``: the item size, which ``shuffle-zstd`` unshuffles by)."""
        from shardkeeper.core.codec.compression import ENCODING, SHUFFLED, decompress_into

        where = (
            f"{self.where}: key {key!r}, {self.storage.describe(path)} bytes "
            f"[{chunk.offset}, {chunk.offset + chunk.length})"
        )
        if chunk.encoding not in (ENCODING, SHUFFLED):  # only a manifest that was not validated
            raise CorruptCheckpointError(f"{where}: unknown encoding {chunk.encoding!r}")
        decompress_into(stored, out, where, isz if chunk.encoding == SHUFFLED else 1)

    def read_chunk(self, path: str, chunk: ChunkRecord, out: memoryview, key: str, isz: int) -> None:
        """The whole chunk's raw bytes into ``out``: read (straight into ``out`` when raw),
        every block checked, then decoded when encoded (a frame cannot be entered midway)."""
        raw = chunk.encoding == "raw"
        stored = out if raw else memoryview(cast("Buffer", np.empty(chunk.length, dtype=np.uint8)))
        self.read(path, chunk.offset, stored, [key])
        self.check(path, chunk, 0, stored, key)
        if not raw:
            self.decode(path, chunk, stored, out, key, isz)

    def scan(self, path: str, chunk: ChunkRecord, window: int) -> Iterator[Window]:
        """The chunk's stored bytes in reads of at most ``window`` bytes (a multiple of the
        block size) through one buffer, each with its mismatched blocks: for a checker that
        reports every problem instead of raising at the first. A failed read is the last."""
        buf = memoryview(cast("Buffer", np.empty(min(window, chunk.length), dtype=np.uint8)))
        for pos in range(0, chunk.length, window):
            n = min(window, chunk.length - pos)
            start = chunk.offset + pos
            view = buf[:n]
            try:
                self.storage.read_into(path, start, view)
            except CheckpointError as e:
                yield Window(start, start + n, None, e, [])
                return
            yield Window(
                start, start + n, view, None, list(mismatches(self.digest, chunk, pos // self.block, view, self.block))
            )


__all__ = ["FRAME_HEADER_BYTES", "ChunkReader", "Mismatch", "Window", "frame_problem", "mismatches", "size_or_none"]
