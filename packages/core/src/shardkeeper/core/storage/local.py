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
import stat
import threading
from pathlib import Path

from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    StorageError,
)
from shardkeeper.core.storage import noreplace
from shardkeeper.core.storage.base import Capabilities
from shardkeeper.core.storage.local_paths import (
    NO_HARD_LINKS,
    O_CLOEXEC,
    O_NOFOLLOW,
    RootPaths,
    pread_some,
    read_some,
    write_all,
)

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
    """A checkpoint root on a local or network POSIX file system.

    It never reads, lists, writes or deletes through a symbolic link that leaves the root,
    reads only regular files, and reports entries that are not what the format puts there as
    damage (``local_paths`` has the rules).
    """

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

    def exists(self, path: str) -> bool:
        try:
            self._paths.stat(path)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return False
        return True

    def size(self, path: str) -> int:
        return self._paths.stat(path).st_size

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
    def open_writer(self, path: str) -> _LocalWriter:
        full = self._paths.real_dirs(path, "write")
        try:
            return _LocalWriter(Path(full), self._fsync, self._direct)
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0o644)
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
