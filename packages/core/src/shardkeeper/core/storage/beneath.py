"""Opening a file beneath a directory in one system call: Linux ``openat2(RESOLVE_BENEATH)``.

The kernel resolves the path relative to a directory fd and fails (``EXDEV``) if any step of
it, symbolic links included, would leave that directory; magic links (``/proc/*/fd``) are
refused. So an fd it returns is inside the root by construction, at the cost of one system
call, where checking after a plain ``open`` costs a ``readlink`` of ``/proc/self/fd``.

:meth:`Beneath.open` returns -1 whenever it cannot answer (no ``openat2``: Linux before 5.6,
another OS, a seccomp filter; an absolute link, which ``RESOLVE_BENEATH`` refuses even when it
points back inside; any error at all): the caller then takes its slower path, which decides
and reports errors. The directory fd is opened lazily, per process (a forked or unpickled
copy opens its own), and replaced when the root is replaced; an old one is kept open until
the object goes, since another thread may still be resolving against it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from typing import Any

_SYS_OPENAT2 = 437  # the same on every architecture listed below
_ARCHES = frozenset({"x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x"})
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
# Answers that mean "openat2 is not usable here": switch it off for the process.
_UNUSABLE = frozenset({errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG})


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load() -> Any:
    if not sys.platform.startswith("linux") or platform.machine() not in _ARCHES or not hasattr(os, "O_PATH"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return syscall


_syscall = _load()


class Beneath:
    """Opens paths beneath the directory ``root`` (a path; it may be a symbolic link)."""

    def __init__(self, root: str, flags: int) -> None:
        self._root = root
        self._flags = flags
        self._how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
        self._how_ref = ctypes.byref(self._how)
        self._how_size = ctypes.sizeof(self._how)
        self._fd = -1  # valid in the process ``_owner`` only
        self._owner = -1
        self._old: list[int] = []  # replaced root fds, closed with the object
        self._lock = threading.Lock()

    def open(self, path: str) -> int:
        """An fd of ``path`` (relative to the root) opened with the flags given, or -1."""
        global _syscall
        if _syscall is None or "\x00" in path:  # a C string would end at the NUL: let open() refuse it
            return -1
        fd = self._fd if self._owner == os.getpid() else -1
        if fd < 0:
            fd = self._open_root()
            if fd < 0:
                return -1
        try:
            name = os.fsencode(path)
        except UnicodeError:  # (a lone surrogate: let open() say what is wrong)
            return -1
        out = int(_syscall(_SYS_OPENAT2, fd, name, self._how_ref, self._how_size))
        if out >= 0:
            return out
        code = ctypes.get_errno()
        if code in _UNUSABLE:
            _syscall = None
        elif code == errno.ENOENT:
            self._check_root(fd)
        return -1

    def _open_root(self) -> int:
        with self._lock:
            pid = os.getpid()
            if self._owner != pid:  # first use, or a fork: the parent's fds are not ours
                self._fd, self._old, self._owner = -1, [], pid
            if self._fd < 0:
                try:
                    self._fd = os.open(self._root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    return -1  # no root yet: the slow path says what is wrong
            return self._fd

    def _check_root(self, fd: int) -> None:
        """After ENOENT: if the root was replaced (removed and made again), use the new one."""
        try:
            now, held = os.stat(self._root), os.fstat(fd)
        except OSError:
            return
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            with self._lock:
                if self._fd == fd and self._owner == os.getpid():
                    self._old.append(fd)
                    self._fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return (Beneath, (self._root, self._flags))  # a copy opens its own fd

    def __del__(self) -> None:
        if self._owner == os.getpid():
            for fd in [self._fd, *self._old]:
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass


__all__ = ["Beneath"]
