"""``put_if_absent`` on a backend without a conditional write: check, then write, under a
process-local lock, and say once per protocol in the log that it is not atomic across processes."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

from shardkeeper.core.errors import CommitConflictError

log = logging.getLogger(__name__)

_lock = threading.Lock()
_warned_protocols: set[str] = set()
_warned_lock = threading.Lock()


def put_checked(
    protocol: str, url: str, where: str, full: str, exists: Callable[[], bool], put: Callable[[], None]
) -> None:
    """``put()`` unless ``exists()``, both under the lock; ``where`` names the object in the
    error, ``full`` is its backend path, ``protocol`` and ``url`` those of its root."""
    _warn_once(protocol, url)
    with _lock:
        if exists():
            raise CommitConflictError(f"{where} already exists (put_if_absent)") from FileExistsError(
                errno.EEXIST, "object exists", full
            )
        put()


def _warn_once(protocol: str, url: str) -> None:
    with _warned_lock:
        if protocol in _warned_protocols:
            return
        _warned_protocols.add(protocol)
    log.warning(
        "%s:// has no conditional write: put_if_absent on %s checks then writes, which is "
        "atomic only among threads of this process; two jobs committing the same step "
        "concurrently could both succeed",
        protocol,
        url,
    )


__all__ = ["put_checked"]
