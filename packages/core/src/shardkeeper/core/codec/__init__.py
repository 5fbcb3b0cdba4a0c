"""Chunk codecs: what happens to a chunk's bytes between staging and storage.

``incremental`` (a chunk equal to one of the previous checkpoint becomes a reference to it)
and ``compression`` (zstd per chunk); below them, client-side encryption of data files and
manifests (``crypto*``, the key providers in ``keys``, the keys a root needs in ``key_usage``);
and ``read``, the chunk reader that restore, verify and export read stored bytes through. See
``docs/codecs.md``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardkeeper.core.codec.incremental import ReuseIndex
    from shardkeeper.core.codec.keys import KeyProvider
    from shardkeeper.core.format.manifest import Manifest
    from shardkeeper.core.storage.base import Storage


@dataclass(frozen=True)
class Codecs:
    """What the writer does to chunk bytes (docs/codecs.md); all off by default."""

    reuse: ReuseIndex | None = None  # incremental: chunks of the previous checkpoint
    compression: str | None = None  # "zstd" or None
    level: int = 3

    @property
    def active(self) -> bool:
        return self.reuse is not None or self.compression == "zstd"


class CodecState:
    """Per manager: builds each save's ``Codecs``, caching the base manifest between saves
    (it is re-read only when a newer step was committed)."""

    def __init__(
        self, *, incremental: bool, compression: str | None, level: int, keys: KeyProvider | None = None
    ) -> None:
        from shardkeeper.core.codec.compression import check_options

        check_options(compression, level)
        self.incremental = incremental
        self.compression = None if compression in (None, "none") else compression
        self.level = level
        self.keys = keys  # the manager encrypts: its base must be encrypted, under the key it wraps with
        self._base: Manifest | None = None

    @property
    def encrypted(self) -> bool:
        return self.keys is not None

    def for_save(self, storage: Storage, step: int, algorithm: str, block_bytes: int) -> Codecs:
        """The codecs of the save of ``step``: the base of an incremental save is the newest
        committed step below it (read on the writer's thread, never the caller's), and only if
        its files are what this manager writes: encrypted exactly when it encrypts. A reference
        to a file of another encryption state would make the new step unreadable (ciphertext
        taken for data, or data without the key), so such a base is not used: the save is full.
        Encrypted, a chunk is referenced only in a file sealed under the key the provider wraps
        with now (``sealed``): after a rotation the save is full once, then incremental on the
        new key, and no step keeps needing the old key through references."""
        reuse = None
        if self.incremental:
            from shardkeeper.core.codec.incremental import (
                ReuseIndex,
                newest_manifest,
                newest_step_below,
            )

            newest = newest_step_below(storage, step)
            if newest is None:
                self._base = None
            elif self._base is None or self._base.step != newest:
                self._base = newest_manifest(storage, before=step)
            if self._base is not None and (self._base.encryption is not None) == self.encrypted:
                reuse = ReuseIndex(self._base, algorithm, block_bytes, self._sealed(storage))
        return Codecs(reuse, self.compression, self.level)

    def _sealed(self, storage: Storage) -> Callable[[str], bool] | None:
        """Encrypted: whether a data file is sealed under the key the provider wraps with now
        (read per save: a provider may rotate in place), from the file's header."""
        if self.keys is None:
            return None
        from shardkeeper.core.codec.crypto import EncryptedStorage

        current = self.keys.key_id
        if not isinstance(storage, EncryptedStorage):
            return lambda path: False  # (the key of a file cannot be told: reference none)
        return lambda path: storage.sealed_under(path) == current


__all__ = ["CodecState", "Codecs"]
