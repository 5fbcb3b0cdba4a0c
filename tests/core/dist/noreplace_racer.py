"""One of two processes racing ``LocalStorage.put_if_absent`` on the same names, on a file
system that (as far as this process can tell) has no hard links.

    noreplace_racer.py NAME MODE ROOT START ROUNDS INTERVAL_S OUT_JSON

``os.link`` is replaced by one that fails with EPERM, as on file systems without hard links
(no such file system is available to the tests). MODE ``renameat2`` leaves the fallback to
``renameat2(RENAME_NOREPLACE)``; MODE ``excl`` also makes that refuse (EINVAL, as a file
system without it answers), so the exclusive create of the final name is what remains.
Round ``i`` starts at wall-clock time ``START + i * INTERVAL_S`` (both processes spin until
then) and puts ``r<i>/manifest.json`` with bytes naming this process. OUT_JSON gets, per
round, ``won``, ``conflict`` or the error, and how often the fallback was called.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path

from shardkeeper.core.errors import CommitConflictError
from shardkeeper.core.storage import LocalStorage

try:
    from shardkeeper.core.storage import noreplace
except ImportError:  # sources without the fallback: the race shows what they do
    noreplace = None  # type: ignore[assignment]

CALLS = {"rename_noreplace": 0}


def _no_hard_links(src: object, dst: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.EPERM, "Operation not permitted (this file system has no hard links)")


def _counted(real):  # noqa: ANN001, ANN202
    def rename_noreplace(src: str, dst: str) -> None:
        CALLS["rename_noreplace"] += 1
        real(src, dst)
    return rename_noreplace


def _no_rename_noreplace(src: str, dst: str) -> None:
    CALLS["rename_noreplace"] += 1
    raise OSError(errno.EINVAL, "Invalid argument (RENAME_NOREPLACE not supported)")


def payload(name: str, i: int) -> bytes:
    return json.dumps({"writer": name, "round": i, "pad": name * 2000}).encode()


def main(name: str, mode: str, root: str, start: float, rounds: int, interval: float, out: Path) -> None:
    os.link = _no_hard_links  # type: ignore[assignment]
    if noreplace is not None:
        noreplace.rename_noreplace = _no_rename_noreplace if mode == "excl" else _counted(noreplace.rename_noreplace)
    storage = LocalStorage(root, fsync=False)
    results = []
    for i in range(rounds):
        at = start + i * interval
        while time.time() < at:
            pass
        try:
            storage.put_if_absent(f"r{i:04d}/manifest.json", payload(name, i))
            results.append("won")
        except CommitConflictError:
            results.append("conflict")
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append(f"error: {type(e).__name__}: {e}")
    out.write_text(json.dumps({"results": results, "calls": CALLS}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]),
         Path(sys.argv[7]))
