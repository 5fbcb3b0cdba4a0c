"""Which saves are still being committed by a persist process, as a restore on the same node
must know before it chooses a step.

A save handed to a persist process holds a lock file for as long as its commit may still
happen: the trainer creates the file and takes an exclusive ``flock`` on it before it sends the
save, and passes the descriptor along with the save; the persist process holds it until the
save's outcome is known, then removes the file. The lock belongs to the open file, so it stays
held while either process holds the descriptor (and while it travels between them), and the
kernel drops it when both are gone, a crash included: a file left behind by a killed process
is never locked, and the next waiter removes it.

``wait_for_commits`` is what a restore calls first: it waits, up to a timeout, for every lock
of the same root on this node that another manager holds (a trainer killed right after
``save()`` returned leaves its persist process committing), so that the restore never chooses
an older step while a newer one is about to commit.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

from shardkeeper.core.codec.crypto_format import root_identity
from shardkeeper.core.errors import CheckpointError, CheckpointTimeoutError

log = logging.getLogger(__name__)

_POLL_S = 0.05


def lock_dir() -> Path:
    """Where this user's in-flight locks live on this node (``SHARDKEEPER_PERSIST_LOCKS``
    overrides it): a directory of this user's alone, so that nobody else can plant a file or a
    link there."""
    given = os.environ.get("SHARDKEEPER_PERSIST_LOCKS")
    if given:
        if not os.path.isabs(given):
            raise CheckpointError(
                f"SHARDKEEPER_PERSIST_LOCKS={given!r} is relative: a restart from another directory would not "
                f"see the locks; give an absolute path"
            )
        return Path(given)
    # /tmp, not $TMPDIR: a scheduler may give each job its own, and a restart must see the locks
    # of the job before it.
    base = "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()
    return Path(base) / f"shardkeeper-persist-{os.getuid()}"


def _own_dir() -> Path:
    """``lock_dir()``, made if missing, and checked to be a real directory this user owns that
    no one else may write to (a shared temporary directory is a place for link attacks)."""
    where = lock_dir()
    try:
        where.mkdir(mode=0o700, exist_ok=True)  # (its parent must exist: no tree made by a typo)
    except OSError as e:
        raise CheckpointError(
            f"the persist lock directory {where} cannot be made ({type(e).__name__}: {e}); set "
            f"SHARDKEEPER_PERSIST_LOCKS to a directory of yours (its parent must exist)"
        ) from None
    st = os.lstat(where)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise CheckpointError(
            f"the persist lock directory {where} is not a directory of this user's alone (a link, another "
            f"user's, or writable by others); remove it, or set SHARDKEEPER_PERSIST_LOCKS to a directory of yours"
        )
    return where


def root_tag(url: str) -> str:
    """A short name of the root ``url`` for lock file names: of its identity, so that every
    spelling of one root (through a link, relative, ``file://``) has the same."""
    return hashlib.sha256(root_identity(url).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def short(namespace: str) -> str:
    """The part of a manager's namespace that names its locks (``shardkeeper/<hex>``: the hex)."""
    return namespace.rsplit("/", 1)[-1]


def _at(fd: int, path: Path | str) -> bool:
    """``fd`` is the file at ``path`` (not one removed from it between its open and its lock)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return False


def hold(url: str, namespace: str, rank: int, step: int) -> tuple[int, Path]:
    """An open, exclusively locked file for the save of ``step`` by ``rank`` of the manager
    ``namespace`` on the root ``url``: its descriptor and path."""
    path = _own_dir() / f"{root_tag(url)}.{short(namespace)}.{rank}.{step}.lock"
    while True:  # (a stale file there may be removed by a waiter between the open and the lock)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        if _at(fd, path):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} rank {rank} step {step}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def mark(fd: int, rank: int, step: int) -> None:
    """The persist process that now holds the lock ``fd`` names itself in it (the trainer that
    took it may be gone: the process to wait for, or to kill, is this one)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (the persist process of rank {rank}) step {step}\n".encode(), 0)
    except OSError:  # (a name in a message only)
        pass


def release(fd: int, path: Path | str) -> None:
    """The save's outcome is known: remove its lock file, then drop the lock."""
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _held_by_others(url: str, namespace: str) -> list[Path]:
    ns = short(namespace) if namespace else None
    if not lock_dir().exists():
        return []
    names = os.listdir(_own_dir())
    tag = root_tag(url) + "."
    out = []
    for name in names:
        if name.startswith(tag) and name.endswith(".lock") and name.split(".")[1] != ns:
            out.append(lock_dir() / name)
    return sorted(out)


def clear_if_free(path: Path | str) -> bool:
    """True when ``path`` is no longer locked (it is then removed), or is gone."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    if not _at(fd, path):  # released meanwhile, and the path may be a new holder's file now
        os.close(fd)
        return clear_if_free(path)
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)
    return True


def _describe(path: Path) -> str:
    try:
        return path.read_text().strip() or path.name
    except OSError:
        return path.name


def wait_for_commits(url: str, namespace: str, timeout_s: float, *, rank: int) -> float:
    """Block until no persist process of another manager than ``namespace``'s ("": any) still
    commits a save to the root ``url`` on this node; the seconds waited. Past ``timeout_s``: ``CheckpointTimeoutError``
    naming the process (kill it to go on without its save)."""
    t0 = time.monotonic()
    pending = _held_by_others(url, namespace)
    logged = False
    while pending:
        pending = [p for p in pending if not clear_if_free(p)]
        if not pending:
            break
        waited = time.monotonic() - t0
        if not logged:
            log.warning(
                "rank %d: waiting for %d save(s) to %s still being committed by another manager's persist process "
                "(%s) before choosing the newest step",
                rank,
                len(pending),
                url,
                "; ".join(_describe(p) for p in pending),
            )
            logged = True
        if waited > timeout_s:
            raise CheckpointTimeoutError(
                f"rank {rank}: another manager's persist process still commits a save to {url} after "
                f"{waited:.0f} s ({'; '.join(_describe(p) for p in pending)}; lock files {', '.join(map(str, pending))}); "
                f"restoring now could take an older step than the one it commits. Wait, or kill that process "
                f"(its save is then not committed) and restore again"
            )
        time.sleep(_POLL_S)
    return time.monotonic() - t0


def check_dir() -> None:
    """``CheckpointError`` now when the lock directory is unusable (a manager checks it when it
    is made, not at its first save)."""
    _own_dir()


__all__ = ["check_dir", "clear_if_free", "hold", "mark", "lock_dir", "release", "root_tag", "wait_for_commits"]
