"""The persist process of a manager with a node-local tier (``writer="process"``, ``local=``):
``python -m shardkeeper.core.tiers.process_writer FD`` runs ``persist/worker.py`` with the
tiers' writer, ``open_tiered``.

What each process owns. The persist processes run every save's tier hooks (``two_tiers.py``):
they write into the node's directory, send replicas or parity to the other nodes' persist
processes over a gloo group of their own (met on the store rank 0's persist process hosts),
commit into the coordinator's node directory, record the commit on every node, upload to the
persistent root in the background and apply both tiers' retention. The trainer keeps the
tiers it opened with the manager (its own gloo group, on the job's store) for restore,
``delete()`` and the listings; it asks its persist process about the uploads over the channel
(``RemoteUploads``) and has it run a preemption's final upload. The two never write a node's
directory at once: a restore or ``delete()`` first waits for the manager's pending save and,
when it needs it, for the running upload; a restarted trainer first waits for the save
locks (``persist/locks.py``, keyed by the node's directory) that an earlier trainer's persist
processes still hold, until the step is committed and recorded on every node.
"""

from __future__ import annotations

import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.persist.meeting import SEEN_WAIT_S, Meeting
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.persist.worker import Writer, main
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.tiers.opening import open_tiers
from shardkeeper.core.tiers.tiering import Tiering
from shardkeeper.core.tiers.two_tiers import TwoTiers
from shardkeeper.core.tiers.wire import TierCoord

ENTRY = "shardkeeper.core.tiers.process_writer"


def _tier_coord(coord: Any) -> Any:
    """Where the persist processes' tiers meet: the store rank 0's persist process hosts (a
    ``Meeting``), or for one process the in-process store of ``TierCoord.of``."""
    if not isinstance(coord, Meeting):
        return coord
    inner = coord.current()
    return TierCoord(inner.save_store, coord.raw_store, inner.namespace, coord.rank, coord.world_size)


def open_tiered(spec: PersistSpec, coord: Any, io: ThreadPoolExecutor) -> Writer:
    """Both tiers opened as the manager opened them, and the tiers' state (a collective of
    the persist processes: the nodes are found again, by the same tokens)."""
    t, opts = spec.tiers or {}, spec.options
    local, persistent = open_tiers(spec.root, t["local"], spec.storage_options, opts)
    ctx = ManagerContext(local.storage, local.read, coord, opts, io, local.encryption)
    erasure = t.get("erasure")
    with warnings.catch_warnings():  # (a lowered ``replicas`` was said once, by the trainer)
        warnings.simplefilter("ignore")
        tiering = Tiering(
            _tier_coord(coord),
            local=local,
            persistent=persistent,
            persist_every=t.get("persist_every"),
            replicas=int(t.get("replicas") or 0),
            erasure=tuple(erasure) if erasure else None,
            local_keep=t.get("local_keep"),
            retention=t.get("retention") or RetentionPolicy(),
            catalog=opts.catalog,
            io=io,
            timeout_s=opts.commit_timeout_s,
        )

    def close(ending: bool) -> None:
        broken = tiering.group.broken
        if ending and broken is not None and tiering.rank == 0:  # a rank's persist process is gone
            try:
                tiering.persister.abandon(f"the tiers' group broke ({broken}): a rank's persist process is gone")
            except Exception:  # noqa: BLE001 - the join below waits for the upload's own end then
                pass
        tiering.persister.join()
        # (ending: a rank's persist process may be dead, and the others' end too: no wait for its ack)
        if tiering.rank == 0 and tiering.coord.world_size > 1 and not ending:
            tiering.persister.await_acks(SEEN_WAIT_S)
        tiering.close()

    return Writer(ctx, TwoTiers(ctx, tiering), tiering.persister, close, tiering.upload_newest)


__all__ = ["ENTRY", "open_tiered"]


if __name__ == "__main__":
    sys.exit(main(sys.argv, open_tiered))
