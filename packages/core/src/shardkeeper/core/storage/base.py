"""The storage protocol: where the bytes go. Small on purpose; capabilities are attributes.

All paths are ``/``-separated and relative to the storage root. Implementations translate
their backend's errors into shardkeeper's (``CheckpointNotFoundError``, ``CommitConflictError``,
``StorageError``), keeping the original as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shardkeeper.core.errors import CheckpointNotFoundError


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees; the commit protocol reads these, never the backend's type."""

    atomic_put_if_absent: bool  # put_if_absent() is atomic against concurrent writers
    ranged_read: bool  # read_range() costs only the bytes asked for
    durable_writes: bool  # a closed writer's bytes survive a crash (fsync or object-store PUT)
    directories: bool  # empty directories exist (POSIX) rather than being key prefixes
    #: every call is a network round trip (an object store): independent calls go in parallel
    remote: bool = False


@runtime_checkable
class Writer(Protocol):
    """A file being written. ``close()`` makes the bytes durable; ``abort()`` discards them.

    Callers keep the bytes passed to ``write()`` unchanged until ``close()`` returns: a
    retrying wrapper (``storage.retry``) replays them, by reference, after a transient fault.
    """

    def write(self, data: memoryview | bytes) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """A checkpoint root. Thread-safe: writers and readers run on background threads."""

    url: str
    capabilities: Capabilities

    def list_dir(self, path: str) -> list[str]:
        """Names directly under ``path`` ("" is the root); empty if it does not exist (and, on
        local disk, if it is or passes through a symbolic link: what is listed may be deleted)."""
        ...

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def mtime(self, path: str) -> float:
        """Last modification, seconds since the epoch."""
        ...

    def read_bytes(self, path: str) -> bytes: ...

    def read_range(self, path: str, offset: int, length: int) -> bytes: ...

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes at ``[offset, offset + len(buffer))``."""
        ...

    def open_writer(self, path: str) -> Writer:
        """A new file at ``path``; it must not exist yet. Parent directories are created."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make the directory entries under ``path`` durable (fsync of a POSIX directory)."""
        ...

    def put_if_absent(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` in one step, or raise ``CommitConflictError`` if it exists."""
        ...

    def put(self, path: str, data: bytes) -> None:
        """Write or replace ``path`` atomically (readers see the old or the new bytes)."""
        ...

    def delete(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""
        ...

    def delete_dir(self, path: str) -> None:
        """Delete a directory and everything under it; missing is not an error."""
        ...

    def describe(self, path: str) -> str:
        """The full location of ``path``, for messages."""
        ...


def size_or_missing(storage: Storage, path: str) -> int:
    """``storage.size(path)``, -1 where the file is missing."""
    try:
        return storage.size(path)
    except CheckpointNotFoundError:
        return -1


def _batch_answers(storage: object) -> bool:
    """Whether ``storage`` has a batch (``sizes``) that answers as its ``size`` does: the
    class defining ``sizes`` is the one whose ``size`` is in force (no subclass replaced it,
    none was set on the instance)."""
    owner = next((c for c in type(storage).__mro__ if "sizes" in vars(c)), None)
    return (
        owner is not None
        and getattr(type(storage), "size", None) is getattr(owner, "size", None)
        and "size" not in getattr(storage, "__dict__", {})
    )


def sizes_of(storage: Storage, paths: Sequence[str]) -> list[int]:
    """The size of each of ``paths``, -1 for a missing one: the storage's own batch where its
    class defines one and no subclass or instance replaced the ``size`` it answers for
    (``sizes``: local disk, one ``fstatat`` a file; a wrapper, the inner storage's batch),
    else ``size`` path by path. (An object forwarding unknown names to another storage is
    asked path by path: its own ``size`` may differ.)"""
    if _batch_answers(storage):
        return list(storage.sizes(paths))  # type: ignore[attr-defined]
    return [size_or_missing(storage, p) for p in paths]


def is_empty_dir(storage: Storage, path: str) -> bool:
    """Whether the entry ``path``, which lists nothing, is a directory rather than a file: an
    empty POSIX directory (never a link) or an object store's folder marker (a zero-byte
    ``path/`` object that consoles and sync tools write). A storage without ``is_dir`` has no
    such entries: False. A storage error propagates."""
    fn = getattr(storage, "is_dir", None)
    return bool(fn(path)) if fn is not None else False


__all__ = ["Capabilities", "Storage", "Writer", "is_empty_dir", "size_or_missing", "sizes_of"]
