"""What the parts of a ``CheckpointManager`` share: its root, its coordinator, its I/O threads.

The manager opens its root (``open_root``), builds one ``ManagerContext`` and hands it to the
save protocol (``save/runner.py``), restore (``restore/restorer.py``) and ``delete()`` (``lifecycle/delete.py``);
none of them holds the manager itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from shardkeeper.core.codec.crypto import EncryptedStorage
from shardkeeper.core.codec.keys import KeyProvider, key_provider
from shardkeeper.core.runtime.binding import refuse_local_tier
from shardkeeper.core.runtime.coordinator import Coordinator
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.storage.retry import RetryPolicy, with_retries


class Settings(Protocol):
    """The options the save and restore protocols read (``CheckpointOptions`` provides them)."""

    @property
    def staging(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def digest_block_bytes(self) -> int: ...
    @property
    def logical_check(self) -> str: ...
    @property
    def commit_timeout_s(self) -> float: ...
    @property
    def commit_group_ranks(self) -> int: ...
    @property
    def max_files_per_rank(self) -> int: ...
    @property
    def min_file_bytes(self) -> int: ...
    @property
    def data_prefixes(self) -> int | None: ...
    @property
    def describe_layouts(self) -> bool | None: ...
    @property
    def compression(self) -> str | None: ...
    @property
    def max_read_bytes(self) -> int: ...
    @property
    def share_restore_reads(self) -> bool: ...
    @property
    def catalog(self) -> str | None: ...


@dataclass(frozen=True)
class Encryption:
    """The key of an encrypted root and what its manifests are sealed to (its binding)."""

    keys: KeyProvider
    binding: str


@dataclass(frozen=True)
class ManagerContext:
    storage: Storage
    """Where files are written and read (encrypting and decrypting when keyed)."""
    read_storage: Storage
    """The same root; manifests read through it are authenticated when encrypted."""
    coord: Coordinator
    settings: Settings
    io: ThreadPoolExecutor
    """Parallel file writes and ranged reads."""
    encryption: Encryption | None = None

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def world_size(self) -> int:
        return self.coord.world_size


def open_root(
    root: str | os.PathLike[str] | Storage,
    storage_options: Mapping[str, Any] | None,
    *,
    retry: RetryPolicy,
    encryption: Any,
    bound_to: str | None,
) -> tuple[Storage, Storage, Encryption | None]:
    """The manager's root with retried calls (encrypting when ``encryption`` names a key,
    bound to ``bound_to`` or the root's own name), the view manifests are read through
    (authenticated when encrypted), and the encryption. A node's local tier directory is
    refused as a root (``refuse_local_tier``)."""
    storage: Storage = with_retries(open_storage(root, **dict(storage_options or {})), retry)
    refuse_local_tier(storage)
    keys = key_provider(encryption)
    if keys is None:
        return storage, storage, None
    encrypted = EncryptedStorage(storage, keys, root=bound_to)
    return encrypted, encrypted.authenticated(), Encryption(keys, encrypted.binding)


__all__ = ["Encryption", "ManagerContext", "Settings", "open_root"]
