"""A connection of its own to the c10d store, for one of a manager's paths.

torch's ``TCPStore`` client serialises its operations on one socket: a blocking ``wait``
holds it until the key is set or the wait times out, and every other operation of that
client, from any thread, queues behind it. A manager's paths wait for long (a save for its
outcome, an upload for its persistent commit), so each path gets a client of its own
(``Store.clone``: a new connection to the same server), shared with no other path and never
with the training job's own use of the default store. One path is used by one thread at a
time.

The channel also names a lost store. The store's server runs in rank 0's process (torchrun's
``MASTER_ADDR``, the coordinator's): an operation that fails for another reason than a wait's
timeout means the coordinator is gone, and raises ``CoordinatorLostError`` (torch's error
chained) instead of torch's raw ``DistNetworkError``. A wait's timeout raises ``StoreTimeout``,
which every caller turns into its own ``CheckpointTimeoutError`` naming what it waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardkeeper.core.errors import CheckpointSaveError, CoordinatorLostError, RankLostError, StoreTimeout


def own_connection(store: Any) -> Any:
    """A client of ``store``'s server that no other user of ``store`` shares (``clone``),
    or ``store`` itself where it has none (an in-process ``HashStore`` blocks nobody)."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except (RuntimeError, NotImplementedError):  # a store type without its own clone
        return store


def server_address(store: Any) -> tuple[str, int] | None:
    """The host and port of the ``TCPStore`` server under ``store`` (through its prefixes), or
    None for a store of another kind (a file or in-process store)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


def gloo_group(store: Any, rank: int, world_size: int, timeout: timedelta, label: str) -> Any:
    """A gloo group of ``world_size`` ranks that meet on ``store`` (a prefix of the job's
    store); a store that cannot be reached raises ``CoordinatorLostError`` naming ``label``."""
    try:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    except dist.DistNetworkError as e:
        raise StoreChannel(store, label, own=False)._lost("meeting on", "the store", e) from e


def _first_line(e: BaseException) -> str:
    """torch's store errors carry a C++ stack after their first line."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class StoreChannel:
    """One path's connection to the store (``label``: the path, for errors)."""

    def __init__(self, store: Any, label: str, *, own: bool = True) -> None:
        self.raw = own_connection(store) if own else store
        self.label = label

    def _lost(self, op: str, key: str, e: BaseException) -> CoordinatorLostError:
        return CoordinatorLostError(
            f"the c10d store that the coordinator (rank 0) hosts could not be reached during {self.label} "
            f"({op} {key!r}: {type(e).__name__}: {_first_line(e)}); the coordinator died or its host is gone. "
            f"Restart the job: restore takes the newest committed step"
        )

    def _call(self, op: str, key: str, *args: Any) -> Any:
        try:
            return getattr(self.raw, op)(*args)
        except dist.DistStoreError as e:  # also raised by a get whose key never came
            if "timeout" in str(e).lower():
                raise StoreTimeout(_first_line(e)) from e
            raise self._lost(op, key, e) from e
        except (RuntimeError, NotImplementedError) as e:  # DistNetworkError; older stores' bare errors
            raise self._lost(op, key, e) from e

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key, key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", keys[0] if keys else "", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key, key))

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        self._call("wait", keys[0] if keys else "", list(keys), timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Every key's value in one round trip where the store can, else one each."""
        if not keys:
            return []
        try:
            got = self._call("multi_get", keys[0], list(keys))
        except CoordinatorLostError as e:
            if not isinstance(e.__cause__, NotImplementedError) and "not implemented" not in str(e.__cause__).lower():
                raise
            got = [self._call("get", k, k) for k in keys]
        return [bytes(v) for v in got]


def coordinator_lost(
    step: int, rank: int, error: CoordinatorLostError, *, committed: bool | None
) -> CheckpointSaveError:
    """The save's error when the coordinator's store went away under it: ``committed`` says
    whether the step was (True), was not (False) or may have been (None) committed."""
    status = {
        True: "the step was committed (in the coordinator's node's local tier) before it was lost",
        False: "the step was not committed: the coordinator never had this rank's report",
        None: "this rank had reported, so the coordinator may have committed the step before it died: a restore "
        "after the restart takes it if its manifest is there, else the newest step before it",
    }[committed]
    return CheckpointSaveError(f"save of step {step} on rank {rank}: {error}; {status}", step=step)


def rank_lost(rank: int, what: str, e: BaseException) -> RankLostError:
    """The error of a collective that failed under ``what`` on ``rank``."""
    first = _first_line(e)
    return RankLostError(
        f"rank {rank}: a collective of the manager's ranks failed while {what} ({type(e).__name__}: {first}); "
        f"a rank died or its host is gone. Restart the job: restore takes the newest committed step"
    )


__all__ = [
    "CoordinatorLostError",
    "RankLostError",
    "StoreChannel",
    "StoreTimeout",
    "coordinator_lost",
    "gloo_group",
    "own_connection",
    "server_address",
]
