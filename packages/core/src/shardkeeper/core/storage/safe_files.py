"""Writing a file into a local folder that others may write in too: an export folder, a
Lightning checkpoint directory, a checkpoint root's own small files.

Whoever can write the folder can plant an entry under a name a writer uses: a symbolic link
(dangling or not) or a hard link to a file elsewhere. Opening such a name for writing writes
*through* it, outside the folder, and renaming a planted temporary leaves the final name a
link. So every file here is written the same way:

- to a temporary in the same folder, created by this process: any entry of that name is
  unlinked first (never followed; a directory is refused), then the file is created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW``, which creates a new inode or fails;
- flushed and fsynced, then renamed over the final name: ``rename(2)`` replaces an entry,
  a link included, and never follows it. The temporary must still be the file this process
  created before the rename, and the final name must be it after; the folder is fsynced;
- on failure the temporary is removed only while it is still this process's file.

Names are the caller's: a folder the user named may itself be a link (their choice).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from shardkeeper.core.storage.local_paths import O_CLOEXEC, O_NOFOLLOW

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
_TRIES = 3  # an entry planted again between the unlink and the create: try again, then give up


def remove_entry(path: str) -> bool:
    """Remove the file or link at ``path`` (a link as a link, never what it points at);
    ``False`` when nothing is there. A directory is refused (``IsADirectoryError``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory is where a file is to be written; remove it", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def open_new(path: str, mode: int = 0o644) -> int:
    """A write fd of a new regular file at ``path``, created by this call: whatever entry
    had that name (a file, a link, a hard link to a file elsewhere) is unlinked first."""
    for _ in range(_TRIES):
        remove_entry(path)
        try:
            return os.open(path, _CREATE, mode)
        except FileExistsError:
            continue
    raise FileExistsError(
        errno.EEXIST,
        f"an entry came back each time it was removed ({_TRIES} times): another process writes in this "
        f"folder; stop it, or write somewhere only this job writes",
        path,
    )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swapped(path: str, what: str) -> OSError:
    return OSError(
        errno.EEXIST,
        f"{what} was replaced by another entry while it was written (another process writes in this "
        f"folder); nothing was written through it. Write somewhere only this job writes",
        path,
    )


def publish(tmp: str, final: str, ours: os.stat_result, *, fsync: bool = True) -> None:
    """Rename ``tmp`` (the file ``ours`` describes) over ``final``, replacing whatever entry
    is there, a link as a link; never leave ``final`` anything but that file."""
    st = os.lstat(tmp)
    if not (_same(st, ours) and stat.S_ISREG(st.st_mode)):
        raise _swapped(tmp, "the temporary file")
    os.replace(tmp, final)
    st = os.lstat(final)
    if not _same(st, ours):  # the temporary was swapped between the check and the rename
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                os.unlink(final)
        raise _swapped(final, "the temporary file")
    if fsync:
        _fsync_dir(os.path.dirname(final))


def discard(tmp: str, ours: os.stat_result) -> None:
    """Remove ``tmp`` if it is still the file ``ours`` describes (never another's entry)."""
    with contextlib.suppress(OSError):
        if _same(os.lstat(tmp), ours):
            os.unlink(tmp)


def temp_name(final: str) -> str:
    """A temporary's name beside ``final``, unique to one write."""
    return f"{final}.{uuid.uuid4().hex[:12]}.tmp"


@contextlib.contextmanager
def atomic_file(final: str, tmp: str | None = None, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write; it appears as ``final`` (complete, fsynced) when the block
    ends without error, and is removed otherwise. ``tmp``: the temporary's name (default:
    :func:`temp_name`), in ``final``'s folder; any entry there is unlinked first."""
    tmp = tmp if tmp is not None else temp_name(final)
    fd = open_new(tmp)
    ours = os.fstat(fd)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        publish(tmp, final, ours, fsync=fsync)
    except BaseException:
        discard(tmp, ours)
        raise


def write_file(final: str, data: bytes, *, tmp: str | None = None, fsync: bool = True) -> None:
    """Write ``data`` as ``final`` (see :func:`atomic_file`)."""
    with atomic_file(final, tmp, fsync=fsync) as f:
        f.write(data)


def move_in(src: str, final: str, *, fsync: bool = True) -> None:
    """Rename the regular file ``src``, written in a folder only this process writes (e.g.
    one from ``tempfile.mkdtemp``), over ``final`` as :func:`publish` does."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"not a regular file, so not moved to {final}", src)
    publish(src, final, st, fsync=fsync)


__all__ = ["atomic_file", "discard", "move_in", "open_new", "publish", "remove_entry", "temp_name", "write_file"]
