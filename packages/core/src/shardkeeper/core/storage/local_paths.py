"""What ``LocalStorage`` may do with the paths of a local checkpoint root.

The root is the directory the user names; it may itself be a symbolic link (the user's
choice): "inside the root" means inside its real path. Below it:

- **reads** (``read_*``, ``size``, ``mtime``, ``exists``) follow a symbolic link only while
  it stays inside the root, and read only regular files: never a FIFO, a device or a
  directory, and never more bytes than the file held when it was opened. The file is
  opened non-blocking, then checked before a byte is read: ``fstat``, and where it lies
  (``openat2(RESOLVE_BENEATH)`` opens only beneath the root; without it, ``/proc/self/fd``,
  else ``realpath``);
- **listing** never goes through a link: a path that is a link, or passes through one,
  lists as empty, because what gc and retention list is what they delete. A link is an
  entry of its directory, like a file;
- **writes and deletes** never go through a link: every directory on the way must be a real
  directory of the root. A link itself is deleted as a link (``unlink``), never the tree it
  points at; ``size``/``mtime`` of a link that leaves the root are the link's own;
- **no path climbs above the root**: one whose ``..`` components lead (lexically) above it is
  damage for every operation, read, list, write or delete alike.

An entry that breaks these rules, or that the OS refuses for what it is (a symlink loop, a
file where the format has a directory, a name too long for the file system, a directory
where the format has a file), is *damage*: ``CorruptCheckpointError``, which restore falls
back from and the retry layer never retries. Any other OS error (EIO, EACCES, ENOSPC, ...)
is a ``StorageError``: the storage failed, the checkpoint may be intact.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

from shardkeeper.core.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from shardkeeper.core.storage.beneath import Beneath

#: errno values that say an entry is not what the format puts there (deterministic: retrying
#: or waiting changes nothing), with what each means.
DAMAGE_ERRNOS = {
    errno.ELOOP: "a symbolic link loop (or too many links) is in the way",
    errno.ENOTDIR: "a part of the path is a file where the format has a directory",
    errno.ENAMETOOLONG: "a name is too long for the file system",
    errno.EISDIR: "it is a directory where the format has a file",
}
_PROC_FD = "/proc/self/fd/" if os.path.isdir("/proc/self/fd") else None
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


class RootPaths:
    """The root of a ``LocalStorage``: full paths, containment and error classification."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lexical = str(root)
        self._real: str | None = None
        self._beneath = Beneath(self.lexical, READ_FLAGS)
        self._dirs = Beneath(self.lexical, DIR_FLAGS)

    def full(self, path: str) -> str:
        return f"{self.lexical}/{path}" if path else self.lexical

    def describe(self, path: str) -> str:
        return self.full(path)

    def real_root(self, refresh: bool = False) -> str:
        """The root's real path, cached once the root exists."""
        if self._real is None or refresh:
            real = os.path.realpath(self.lexical)
            if not os.path.isdir(real):
                return real
            self._real = real
        return self._real

    def inside(self, real: str) -> bool:
        """Whether the real path ``real`` is the root or below it (the root's real path is
        looked up again before saying no: it may have been created or moved since)."""
        for refresh in (False, True):
            root = self.real_root(refresh)
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return True
        return False

    def first_link(self, path: str, *, last: bool = True) -> str | None:
        """The first prefix of ``path`` that is a symbolic link, or None (components that do
        not exist are no links). ``last=False`` checks the directories on the way only."""
        return self._walk(path, last)[0]

    def _walk(self, path: str, last: bool = True) -> tuple[str | None, os.stat_result | None]:
        """``first_link``, and the last component's ``lstat`` where every component exists
        and none is a link (then it is also the entry's ``stat``)."""
        self.refuse_climbing(path)
        parts = path.split("/") if path else []
        if not last:
            parts = parts[:-1]
        cur = self.lexical
        st = None
        for i, part in enumerate(parts):
            cur = f"{cur}/{part}"
            try:
                st = os.lstat(cur)
            except (FileNotFoundError, NotADirectoryError):
                return None, None
            if stat.S_ISLNK(st.st_mode):
                return "/".join(parts[: i + 1]), None
        return None, st

    def fd_inside(self, fd: int, path: str) -> bool:
        """Whether the file open as ``fd`` (opened by ``path``) lies inside the root."""
        if _PROC_FD is not None:
            try:
                if self.inside(os.readlink(f"{_PROC_FD}{fd}")):
                    return True
            except OSError:
                pass
        # No /proc, or a "no" to double-check (a mount seen under another name): the path.
        return self.inside(os.path.realpath(self.full(path)))

    def open_read(self, path: str) -> tuple[int, os.stat_result]:
        """An fd of the regular file ``path`` inside the root, and its fstat; or damage.
        Opened non-blocking (a FIFO does not hang the open), checked before any read:
        ``openat2(RESOLVE_BENEATH)`` where it answers, else ``open`` and ``fd_inside``."""
        self.refuse_climbing(path)
        fd = self._beneath.open(path)
        if fd >= 0:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise self.not_readable(path, st.st_mode, True)
            except BaseException:
                os.close(fd)
                raise
            return fd, st
        try:
            fd = os.open(self.full(path), READ_FLAGS)
        except OSError as e:
            raise self.wrap(path, e) from e
        try:
            st = os.fstat(fd)
            inside = self.fd_inside(fd, path)
            if not inside or not stat.S_ISREG(st.st_mode):
                raise self.not_readable(path, st.st_mode, inside)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def stat(self, path: str) -> os.stat_result:
        """The entry at ``path``: followed through links that stay inside the root; a link
        that leaves it (or dangles, or loops) is its own entry; a path through such a link
        is damage."""
        full = self.full(path)
        try:
            link, st = self._walk(path)
            if st is not None:  # every component there, none a link: its lstat is its stat
                return st
            if link is None:
                return os.stat(full)
            last = len(link) == len(path)
            if self.inside(os.path.realpath(full)):
                try:
                    return os.stat(full)
                except OSError as e:
                    dangles_or_loops = isinstance(e, FileNotFoundError) or e.errno == errno.ELOOP
                    if not (last and dangles_or_loops):
                        raise
                    return os.lstat(full)
            if last:
                return os.lstat(full)
        except OSError as e:
            raise self.wrap(path, e) from e
        raise self.leaves(path, link, "read")

    def sizes(self, paths: Sequence[str]) -> list[int | None]:
        """The size of each regular file of ``paths``, -1 where it is missing, None where
        ``stat`` must answer (a link, anything but a regular file, a directory that cannot be
        opened beneath the root, no ``openat2``). Each directory is opened once, beneath the
        root, and each file is one ``fstatat`` relative to it: no walk per path, and nothing
        on the way can be swapped for a link meanwhile."""
        out: list[int | None] = [None] * len(paths)
        by_dir: dict[str, list[int]] = {}
        for i, path in enumerate(paths):
            by_dir.setdefault(path.rpartition("/")[0], []).append(i)
        for head, where in by_dir.items():
            fd = self._dirs.open(head) if head else -1
            if fd < 0:
                continue
            try:
                for i in where:
                    name = paths[i].rpartition("/")[2]
                    if name in ("", ".", ".."):
                        continue
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        out[i] = -1
                        continue
                    except (OSError, ValueError):
                        continue  # (``stat`` says what is wrong)
                    if stat.S_ISREG(st.st_mode):
                        out[i] = st.st_size
            finally:
                os.close(fd)
        return out

    def real_dirs(self, path: str, action: str) -> str:
        """The full path of ``path`` for ``action`` ("write", "delete"), refused (damage) if a
        directory on the way is a link; the last component may be one (it is replaced or
        deleted itself, never followed)."""
        try:
            link = self.first_link(path, last=False)
        except OSError as e:
            raise self.wrap(path, e) from e
        if link is not None:
            raise self.leaves(path, link, action)
        return self.full(path)

    # -- errors ------------------------------------------------------------------------------
    def leaves(self, path: str, link: str | None, action: str) -> CorruptCheckpointError:
        """The error for ``path`` reached through ``link``: for ``action`` "read", a link that
        leaves the root; for "write" and "delete", any link."""
        where = self.full(link if link is not None else path)
        try:
            target = repr(os.readlink(where))
        except OSError:
            target = "?"
        if action == "read":
            why = (
                f"outside the checkpoint root {self.real_root()}; shardkeeper never reads through a link that "
                f"leaves the root, so the entry counts as damage (its step is not committed or not restorable)"
            )
        elif action == "write":
            why = (
                "shardkeeper writes only into real directories of the root (listing, which gc and retention "
                "use, never goes through a link, so what it wrote there would be invisible)"
            )
        else:
            why = "shardkeeper never deletes through a link (it would delete what the link points at)"
        return CorruptCheckpointError(
            f"{self.full(path)}: {where} is a symbolic link to {target}, {why}. Remedy: move what it points at "
            f"into the root in its place, or remove the link"
        )

    def refuse_climbing(self, path: str) -> None:
        """Raise (damage) if the ``..`` components of ``path`` climb above the root, lexically:
        every operation asks this before the file system sees the path."""
        if ".." in path and posixpath.normpath(f"./{path}").split("/")[0] == "..":
            raise CorruptCheckpointError(
                f"{self.full(path)}: the path climbs above the checkpoint root {self.lexical} ('..'); "
                f"shardkeeper reads, lists, writes and deletes only inside the root, so the entry counts as "
                f"damage. Remedy: restore another step, and fix or remove what names this path"
            )

    def not_readable(self, path: str, mode: int, inside: bool) -> CorruptCheckpointError:
        if not inside:
            return self.leaves(path, self.first_link(path), "read")
        return CorruptCheckpointError(
            f"{self.full(path)} is {kind(mode)}, not a regular file; the format stores only regular files, so "
            f"the entry counts as damage and is never read. Remedy: remove it (restore falls back to an earlier "
            f"step meanwhile)"
        )

    def wrap(self, path: str, e: OSError) -> Exception:
        """``e`` as shardkeeper's error: missing, damage (``DAMAGE_ERRNOS``) or a storage failure."""
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{self.full(path)} does not exist")
        why = DAMAGE_ERRNOS.get(e.errno or 0)
        if why is not None:
            return CorruptCheckpointError(
                f"{self.full(path)}: {why} ({e.strerror}); the entry is not what the checkpoint format puts "
                f"there, so its step counts as damaged. Remedy: restore another step (restore() falls back by "
                f"itself), and fix or remove the entry"
            )
        return StorageError(f"local storage failed on {self.full(path)}: {e}")


# --------------------------------------------------------------------------------------------
# fd helpers

READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: a directory held only to resolve names against (``RootPaths.sizes``)
DIR_FLAGS = getattr(os, "O_PATH", 0) | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC
# link(2) errors of file systems without hard links (FAT, some FUSE and network mounts).
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV})


def blocking(fd: int) -> None:
    """Clear O_NONBLOCK (a regular file on a file system that honours it answered EAGAIN)."""
    if fcntl is not None:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)


def pread_some(fd: int, view: memoryview, offset: int) -> int:
    try:
        return os.preadv(fd, [view], offset)
    except BlockingIOError:
        blocking(fd)
        return os.preadv(fd, [view], offset)


def read_some(fd: int, n: int) -> bytes:
    try:
        return os.read(fd, n)
    except BlockingIOError:
        blocking(fd)
        return os.read(fd, n)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view) :]


__all__ = [
    "DAMAGE_ERRNOS",
    "NO_HARD_LINKS",
    "O_CLOEXEC",
    "O_NOFOLLOW",
    "READ_FLAGS",
    "RootPaths",
    "kind",
    "pread_some",
    "read_some",
    "write_all",
]
