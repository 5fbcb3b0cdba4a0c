"""Local (POSIX) storage done right.

- Data files are created exclusively (``O_EXCL``), written, fsynced, then their directory is
  fsynced: a manifest never points at bytes that a crash could lose.
- The manifest is written to a temporary file in the destination directory, fsynced, then
  *linked* to its final name: ``link(2)`` fails if the name exists, so the commit is an atomic
  put-if-absent (a rename would silently replace a concurrent winner). The directory is fsynced.
- Writes of 1 MiB or more go out with ``O_DIRECT`` (docs/decisions.md D19): no copy into the
  page cache and no writeback later, which is most of the CPU a buffered write costs. Memory
  congruent with the file offset modulo the page size (the staging buffer's) goes to the disk
  as it is; other memory (tensors written in place by synchronous saves, compressed or
  encrypted chunks) is copied through a page-aligned bounce buffer first. The unaligned head
  and the last partial page are written buffered; where the file system refuses ``O_DIRECT``
  the writer falls back to buffered writes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import threading
from pathlib import Path

from shardkeeper.core.errors import CheckpointNotFoundError, CommitConflictError, StorageError
from shardkeeper.core.storage.base import Capabilities

try:
    import fcntl
except ImportError:  # not POSIX: no O_DIRECT either
    fcntl = None  # type: ignore[assignment]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Alignment of O_DIRECT writes (memory address, file offset, length): the page size, which
#: is a multiple of the logical block size of the disks this runs on.
DIRECT_ALIGN = 4096
#: Writes shorter than this stay buffered: O_DIRECT saves nothing worth two fcntl calls there.
DIRECT_MIN_BYTES = 1 << 20
#: The page-aligned buffer (one per writer, made on first use) through which memory that is not
#: congruent with the file offset is copied for O_DIRECT: a memcpy instead of the page-cache
#: copy and its writeback.
BOUNCE_BYTES = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0) if fcntl is not None else 0


def _address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for read-only ones, like bytes)."""
    if view.readonly or not len(view):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _LocalWriter:
    def __init__(self, path: Path, fsync: bool, direct: bool = False) -> None:
        self._path = path
        self._fsync = fsync
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._pos = 0
        self._direct = direct and bool(_O_DIRECT)
        #: bytes that went out with O_DIRECT, and those of them copied through the bounce buffer
        self.direct_bytes = 0
        self.bounced_bytes = 0
        self._bounce: mmap.mmap | None = None
        self._bounce_mv = memoryview(b"")

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._direct and len(view) >= DIRECT_MIN_BYTES:
            view = self._write_direct(view)
        self._write_buffered(view)

    def _write_buffered(self, view: memoryview) -> None:
        while len(view):
            n = os.write(self._fd, view)
            view = view[n:]
            self._pos += n

    def _write_direct(self, view: memoryview) -> memoryview:
        """Write the page-aligned middle of ``view`` with O_DIRECT (the unaligned head
        buffered, first); return what is left for a buffered write. Memory congruent with the
        file offset goes out as it is; other memory is copied through the bounce buffer."""
        head = -self._pos % DIRECT_ALIGN
        body = (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN
        if body < DIRECT_ALIGN:
            return view
        addr = _address(view)
        zero_copy = addr is not None and (addr + head) % DIRECT_ALIGN == 0
        self._write_buffered(view[:head])
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError:
            self._direct = False  # the file system refuses O_DIRECT: buffered from now on
            return view[head:]
        done = 0
        try:
            while done < body:
                if zero_copy:
                    want = body - done
                    n = os.write(self._fd, view[head + done : head + body])
                else:
                    bounce = self._bounce_view()
                    want = min(len(bounce), body - done)
                    bounce[:want] = view[head + done : head + done + want]
                    n = os.write(self._fd, bounce[:want])
                    self.bounced_bytes += n
                done += n
                self._pos += n
                self.direct_bytes += n
                if n < want:
                    break  # a short write: the rest goes buffered
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False  # EINVAL writes nothing: the same bytes go out buffered
        finally:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
        return view[head + done :]

    def _bounce_view(self) -> memoryview:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned
            self._bounce_mv = memoryview(self._bounce)
        return self._bounce_mv

    def _release(self) -> None:
        if self._bounce is not None:
            self._bounce_mv.release()
            self._bounce.close()
            self._bounce = None

    def close(self) -> None:
        self._release()
        try:
            if self._fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        self._release()
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

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, direct_io: bool = True) -> None:
        """``fsync=False`` gives up durability against power loss (docs/reliability.md);
        ``direct_io=False`` writes every byte through the page cache (docs/decisions.md D19)."""
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._fsync = fsync
        self._direct = direct_io
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
            return _LocalWriter(self._p(path), self._fsync, self._direct)
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
