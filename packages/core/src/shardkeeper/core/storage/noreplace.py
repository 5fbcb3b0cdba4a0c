"""``rename(2)`` that never replaces its destination: Linux ``renameat2(RENAME_NOREPLACE)``.

The kernel checks that the destination is absent and renames in one step, so of two
processes renaming onto one name exactly one succeeds; the other gets ``FileExistsError``.
It is what ``LocalStorage.put_if_absent`` falls back to on file systems without hard links.
Where the platform or the file system lacks it, :func:`rename_noreplace` raises an
``OSError`` with ``errno`` ``ENOSYS`` (no such call) or ``EINVAL`` (the file system refuses
the flag), which callers take as "not available here".
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from collections.abc import Callable

RENAME_NOREPLACE = 1
_AT_FDCWD = -100
# SYS_renameat2, for C libraries without a renameat2() wrapper (glibc < 2.28).
_SYSCALL_NUMBERS = {"x86_64": 316, "aarch64": 276, "arm64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347}

#: errno values meaning "this platform or file system has no RENAME_NOREPLACE" (a seccomp
#: filter that does not know the call answers EPERM).
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP})


def _load() -> Callable[[bytes, bytes], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return lambda src, dst: int(fn(_AT_FDCWD, src, _AT_FDCWD, dst, RENAME_NOREPLACE))
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    return lambda src, dst: int(
        syscall(
            ctypes.c_long(number),
            ctypes.c_int(_AT_FDCWD),
            ctypes.c_char_p(src),
            ctypes.c_int(_AT_FDCWD),
            ctypes.c_char_p(dst),
            ctypes.c_uint(RENAME_NOREPLACE),
        )
    )


_RENAMEAT2 = _load()


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (``FileExistsError``), atomically."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2(RENAME_NOREPLACE) is not available on this platform", dst)
    if _RENAMEAT2(os.fsencode(src), os.fsencode(dst)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)


__all__ = ["RENAME_NOREPLACE", "UNSUPPORTED", "rename_noreplace"]
