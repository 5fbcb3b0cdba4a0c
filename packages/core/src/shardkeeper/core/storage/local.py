"""Local (POSIX) storage done right.

- Data files are created exclusively (``O_EXCL``), written, fsynced, then their directory is
  fsynced: a manifest never points at bytes that a crash could lose.
- The manifest is written to a temporary file in the destination directory, fsynced, then
  *linked* to its final name: ``link(2)`` fails if the name exists, so the commit is an atomic
  put-if-absent (a rename would silently replace a concurrent winner). The directory is fsynced.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

from shardkeeper.core.errors import CheckpointNotFoundError, CommitConflictError, StorageError
from shardkeeper.core.storage.base import Capabilities


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter:
    def __init__(self, path: Path, fsync: bool) -> None:
        self._path = path
        self._fsync = fsync
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        try:
            if self._fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class LocalStorage:
    """A checkpoint root on a local or network POSIX file system."""

    capabilities = Capabilities(
        atomic_put_if_absent=True, ranged_read=True, durable_writes=True, directories=True
    )

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._fsync = fsync
        self._lock = threading.Lock()

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def describe(self, path: str) -> str:
        return str(self._p(path))

    def _wrap(self, path: str, e: OSError) -> Exception:
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{self.describe(path)} does not exist")
        return StorageError(f"local storage failed on {self.describe(path)}: {e}")

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._wrap(path, e) from e

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def size(self, path: str) -> int:
        try:
            return self._p(path).stat().st_size
        except OSError as e:
            raise self._wrap(path, e) from e

    def mtime(self, path: str) -> float:
        try:
            return self._p(path).stat().st_mtime
        except OSError as e:
            raise self._wrap(path, e) from e

    def read_bytes(self, path: str) -> bytes:
        try:
            return self._p(path).read_bytes()
        except OSError as e:
            raise self._wrap(path, e) from e

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        try:
            fd = os.open(self._p(path), os.O_RDONLY)
        except OSError as e:
            raise self._wrap(path, e) from e
        try:
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos:]], offset + pos)
                if n == 0:
                    raise StorageError(
                        f"{self.describe(path)} is shorter than expected: wanted bytes "
                        f"[{offset}, {offset + len(view)}), the file ends at {offset + pos}"
                    )
                pos += n
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise self._wrap(path, e) from e
        finally:
            os.close(fd)

    def open_writer(self, path: str) -> _LocalWriter:
        try:
            return _LocalWriter(self._p(path), self._fsync)
        except FileExistsError as e:
            raise CommitConflictError(
                f"{self.describe(path)} already exists; file names are unique per save attempt, "
                f"so another writer is using this attempt id"
            ) from e
        except OSError as e:
            raise self._wrap(path, e) from e

    def sync_dir(self, path: str) -> None:
        if self._fsync and self._p(path).is_dir():
            _fsync_dir(self._p(path))

    def _write_tmp(self, final: Path, data: bytes) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        return tmp

    def put_if_absent(self, path: str, data: bytes) -> None:
        final = self._p(path)
        try:
            tmp = self._write_tmp(final, data)
        except OSError as e:
            raise self._wrap(path, e) from e
        try:
            os.link(tmp, final)
        except FileExistsError as e:
            raise CommitConflictError(f"{self.describe(path)} already exists") from e
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise self._wrap(path, e) from e
            # File systems without hard links: exclusive create + copy is the best left.
            with self._lock:
                if final.exists():
                    raise CommitConflictError(f"{self.describe(path)} already exists") from e
                os.rename(tmp, final)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self.sync_dir(os.path.dirname(path))

    def put(self, path: str, data: bytes) -> None:
        final = self._p(path)
        try:
            tmp = self._write_tmp(final, data)
            os.replace(tmp, final)
        except OSError as e:
            raise self._wrap(path, e) from e
        self.sync_dir(os.path.dirname(path))

    def delete(self, path: str) -> None:
        try:
            self._p(path).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._wrap(path, e) from e

    def delete_dir(self, path: str) -> None:
        p = self._p(path)
        if p == self.root:
            raise StorageError(f"refusing to delete the checkpoint root {self.url}")
        try:
            shutil.rmtree(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._wrap(path, e) from e
