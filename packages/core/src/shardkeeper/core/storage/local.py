"""Local (POSIX) storage done right.

- Data files are created exclusively (``O_EXCL``), written, fsynced, then their directory is
  fsynced: a manifest never points at bytes that a crash could lose.
- The manifest is written to a temporary file in the destination directory, fsynced, then
  *linked* to its final name: ``link(2)`` fails if the name exists, so the commit is an atomic
  put-if-absent (a rename would silently replace a concurrent winner). The directory is fsynced.
  Without hard links: ``renameat2(RENAME_NOREPLACE)`` (``noreplace``), as atomic; where the
  file system refuses that too, an exclusive create (``O_EXCL``) of the final name, written
  and fsynced in place, still exclusive across processes, though a reader can then see a
  partial manifest for a moment (it takes it for damage and falls back).
- Paths stay inside the root (``local_paths``): no read, listing, write or delete through a
  symbolic link that leaves it, only regular files are read, and entries that are not what
  the format puts there are damage (``CorruptCheckpointError``), not storage failures.
- Data files are written by ``LocalWriter`` (storage/local_writer.py), with ``O_DIRECT`` for
  writes of 1 MiB or more (docs/decisions.md D19).

Layering: the root and its commit protocol here; a data file's bytes (``O_DIRECT``, the bounce
buffer) in storage/local_writer.py, the rules for paths inside the root in local_paths.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    StorageError,
)
from shardkeeper.core.storage import noreplace
from shardkeeper.core.storage.base import Capabilities, size_or_missing
from shardkeeper.core.storage.local_paths import (
    NO_HARD_LINKS,
    O_CLOEXEC,
    O_NOFOLLOW,
    RootPaths,
    pread_some,
    read_some,
    write_all,
)
from shardkeeper.core.storage.local_writer import DIRECT_ALIGN, DIRECT_MIN_BYTES, LocalWriter
from shardkeeper.core.storage.safe_files import open_new


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A checkpoint root on a local or network POSIX file system.

    It never reads, lists, writes or deletes through a symbolic link that leaves the root,
    reads only regular files, and reports entries that are not what the format puts there as
    damage (``local_paths`` has the rules).
    """

    capabilities = Capabilities(atomic_put_if_absent=True, ranged_read=True, durable_writes=True, directories=True)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, direct_io: bool = True) -> None:
        """``fsync=False`` gives up durability against power loss (docs/reliability.md);
        ``direct_io=False`` writes every byte through the page cache (docs/decisions.md D19)."""
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._fsync = fsync
        self._direct = direct_io
        self._paths = RootPaths(self.root)

    def describe(self, path: str) -> str:
        return self._paths.full(path)

    def _wrap(self, path: str, e: OSError) -> Exception:
        return self._paths.wrap(path, e)

    # -- reads -------------------------------------------------------------------------------
    def list_dir(self, path: str) -> list[str]:
        try:
            if path and self._paths.first_link(path) is not None:
                return []  # a link, or through one: never listed (what is listed may be deleted)
            return sorted(os.listdir(self._paths.full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._wrap(path, e) from e

    def subdirs(self, path: str) -> set[str]:
        """The names of the real directories directly under ``path`` (links are not), from one
        listing's entry types: what a walk needs without a stat per file."""
        try:
            if path and self._paths.first_link(path) is not None:
                return set()  # (never listed through a link, as ``list_dir``)
            with os.scandir(self._paths.full(path)) as entries:
                return {e.name for e in entries if e.is_dir(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return set()
        except OSError as e:
            raise self._wrap(path, e) from e

    def exists(self, path: str) -> bool:
        try:
            self._paths.stat(path)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return False
        return True

    def size(self, path: str) -> int:
        return self._paths.stat(path).st_size

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a real directory (a link to one is not: it is deleted as a link)."""
        return stat.S_ISDIR(self._lmode(path))

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (deleting it frees none of what it points at)."""
        return stat.S_ISLNK(self._lmode(path))

    def _lmode(self, path: str) -> int:
        """The mode of the entry at ``path`` itself (0 if there is none)."""
        full = self._paths.real_dirs(path, "read")
        try:
            return os.lstat(full).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as e:
            raise self._wrap(path, e) from e

    def sizes(self, paths: Sequence[str]) -> list[int]:
        """``size`` of each of ``paths``, -1 for a missing one (``storage.base.sizes_of``):
        regular files in one ``fstatat`` each, anything else as ``size`` answers it."""
        got = self._paths.sizes(paths)
        return [size_or_missing(self, p) if n is None else n for p, n in zip(paths, got)]

    def mtime(self, path: str) -> float:
        return self._paths.stat(path).st_mtime

    def read_bytes(self, path: str) -> bytes:
        """The whole file: at most the bytes it held when opened (a file that grows meanwhile
        is read as it was)."""
        fd, st = self._paths.open_read(path)
        try:
            parts, left = [], st.st_size
            while left > 0:
                part = read_some(fd, left)
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except OSError as e:
            raise self._wrap(path, e) from e
        finally:
            os.close(fd)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        fd, _ = self._paths.open_read(path)
        try:
            pos, want = 0, len(view)
            while pos < want:
                n = pread_some(fd, view[pos:], offset + pos)
                if n == 0:
                    raise StorageError(
                        f"{self.describe(path)} is shorter than expected: wanted bytes "
                        f"[{offset}, {offset + want}), the file ends at {offset + pos}"
                    )
                pos += n
        except StorageError:
            raise
        except OSError as e:
            raise self._wrap(path, e) from e
        finally:
            os.close(fd)

    # -- writes ------------------------------------------------------------------------------
    def open_writer(self, path: str) -> LocalWriter:
        full = self._paths.real_dirs(path, "write")
        try:
            return LocalWriter(Path(full), self._fsync, self._direct)
        except FileExistsError as e:
            raise CommitConflictError(
                f"{self.describe(path)} already exists; file names are unique per save attempt, "
                f"so another writer is using this attempt id"
            ) from e
        except OSError as e:
            raise self._wrap(path, e) from e

    def sync_dir(self, path: str) -> None:
        if not self._fsync:
            return
        full = self._paths.full(path)
        try:
            if self._paths.first_link(path) is None and os.path.isdir(full):
                _fsync_dir(Path(full))
        except OSError as e:
            raise self._wrap(path, e) from e

    def _write_tmp(self, final: str, data: bytes) -> str:
        parent, name = os.path.split(final)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = open_new(tmp)  # a link (symbolic or hard) planted at this name is unlinked, never written
        try:
            write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def put_if_absent(self, path: str, data: bytes) -> None:
        """Atomic and exclusive across processes: ``link(2)`` of a fsynced temporary file;
        without hard links, ``renameat2(RENAME_NOREPLACE)``; where the file system refuses
        that too, an exclusive create of the final name, written and fsynced in place (a
        reader can then see a partial manifest for a moment, and takes it for damage)."""
        final = self._paths.real_dirs(path, "write")
        try:
            tmp = self._write_tmp(final, data)
        except OSError as e:
            raise self._wrap(path, e) from e
        try:
            try:
                os.link(tmp, final)
            except OSError as e:
                if isinstance(e, FileExistsError) or e.errno not in NO_HARD_LINKS:
                    raise
                self._put_without_link(tmp, final, data)
        except FileExistsError as e:
            raise CommitConflictError(f"{self.describe(path)} already exists") from e
        except OSError as e:
            raise self._wrap(path, e) from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self.sync_dir(os.path.dirname(path))

    def _put_without_link(self, tmp: str, final: str, data: bytes) -> None:
        try:
            noreplace.rename_noreplace(tmp, final)
            return
        except OSError as e:
            if isinstance(e, FileExistsError) or e.errno not in noreplace.UNSUPPORTED:
                raise
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(final)  # ours (created exclusively): a torn manifest must not stay
            except OSError:
                pass
            raise
        os.close(fd)

    def put(self, path: str, data: bytes) -> None:
        final = self._paths.real_dirs(path, "write")
        try:
            tmp = self._write_tmp(final, data)
            os.replace(tmp, final)
        except OSError as e:
            raise self._wrap(path, e) from e
        self.sync_dir(os.path.dirname(path))

    # -- deletes -----------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        """Delete the file at ``path``; a link is deleted as a link."""
        full = self._paths.real_dirs(path, "delete")
        try:
            os.unlink(full)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise self._wrap(path, e) from e

    def delete_dir(self, path: str) -> None:
        """Delete the directory at ``path`` and everything in it; a link is deleted as a link
        (never the tree it points at), and links below are not followed."""
        rel = os.path.normpath(path) if path else "."
        if rel == "." or rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            raise StorageError(f"refusing to delete the checkpoint root {self.url} (or above it): {path!r}")
        full = self._paths.real_dirs(path, "delete")
        try:
            if stat.S_ISLNK(os.lstat(full).st_mode):
                os.unlink(full)
            else:
                shutil.rmtree(full)
        except (FileNotFoundError, NotADirectoryError) as e:
            if isinstance(e, NotADirectoryError) and os.path.lexists(full):
                raise self._wrap(path, e) from e
        except OSError as e:
            raise self._wrap(path, e) from e


__all__ = ["DIRECT_ALIGN", "DIRECT_MIN_BYTES", "LocalStorage"]
