"""Writes of local data files (``LocalWriter``): created exclusively (``O_EXCL``), written,
fsynced at ``close``; ``abort`` removes the file.

Writes of 1 MiB or more go out with ``O_DIRECT`` (docs/decisions.md D19): no copy into the
page cache and no writeback later, which is most of the CPU a buffered write costs. Memory
congruent with the file offset modulo the page size (the staging buffer's) goes to the disk
as it is; other memory (tensors written in place by synchronous saves, compressed or
encrypted chunks) is copied through a page-aligned bounce buffer first. The unaligned head
and the last partial page are written buffered; where the file system refuses ``O_DIRECT``
the writer falls back to buffered writes.

Layering: below ``LocalStorage`` (storage/local.py), which checks the path inside the root
and opens writers; this module knows nothing of roots, only of one file's bytes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no O_DIRECT either
    fcntl = None  # type: ignore[assignment]

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


class LocalWriter:
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


__all__ = ["BOUNCE_BYTES", "DIRECT_ALIGN", "DIRECT_MIN_BYTES", "LocalWriter"]
