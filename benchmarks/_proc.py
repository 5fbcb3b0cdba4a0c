"""Process and machine measurements for the benchmark (Linux /proc; no third-party packages).

- ``rss_bytes`` / ``hwm_bytes``: VmRSS / VmHWM of this process; ``reset_hwm`` writes "5" to
  /proc/self/clear_refs, which resets VmHWM to the current RSS.
- ``rchar``: bytes this process (all its threads) read through read(2)-family syscalls, from
  /proc/self/io; what DCP and torch.load read is measured this way.
- ``cpu_s``: user + system CPU seconds of this process, all threads (getrusage).
- ``evict``: fsync, then POSIX_FADV_DONTNEED, on every file under a path, so that the next
  read of it comes from the disk, not the page cache.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; False when the kernel refuses (then HWM is since start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("rchar not in /proc/self/io")


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def usage() -> tuple[float, float, int, int]:
    """(user s, system s, minor faults, major faults) of this process so far, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt, ru.ru_majflt


def usage_delta(before: tuple[float, float, int, int]) -> dict[str, float]:
    """What went on between ``before`` and now: CPU split and page faults, to explain outliers
    (on a VM, first-touch page faults and reclaim show up as system time)."""
    u, s, mi, ma = usage()
    return {"cpu_user_s": u - before[0], "cpu_sys_s": s - before[1], "minflt": mi - before[2], "majflt": ma - before[3]}


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``interval_s`` (from /proc/stat): others' activity, when
    this benchmark runs nothing itself."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    import time

    t0, i0 = snap()
    time.sleep(interval_s)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


_libc: Any = None


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that RSS measures live memory only."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def files_under(path: str | os.PathLike[str]) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    return [q for q in p.rglob("*") if q.is_file()]


def evict(path: str | os.PathLike[str]) -> int:
    """fsync + POSIX_FADV_DONTNEED every file under ``path``; return how many files."""
    n = 0
    for q in files_under(path):
        try:
            fd = os.open(q, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def tree_bytes(path: str | os.PathLike[str]) -> int:
    return sum(q.stat().st_size for q in files_under(path))


# -- machine info -------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _mount_of(path: str) -> dict[str, str]:
    """The /proc/mounts entry holding ``path`` (longest matching mount point)."""
    real = os.path.realpath(path)
    best = {"mount_point": "/", "device": "?", "fs": "?"}
    best_len = -1
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs, opts, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
                best = {"mount_point": mnt, "device": dev, "fs": fs, "options": opts}
                best_len = len(mnt)
    return best


def _git_rev(root: Path) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "packages"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev + ("+dirty(packages)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(workdir: str, repo_root: Path) -> dict[str, Any]:
    import torch

    st = os.statvfs(workdir)
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": _mem_total(),
        "disk": {**_mount_of(workdir), "workdir": os.path.realpath(workdir), "free_bytes": st.f_bavail * st.f_frsize},
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "shardkeeper_git": _git_rev(repo_root),
        "load_avg_at_start": os.getloadavg(),
    }
