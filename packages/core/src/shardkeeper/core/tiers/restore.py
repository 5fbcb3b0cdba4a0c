"""A tiered restore, on every rank: choose the tier and step (``choose.py``), restore it, and
fall back across the tiers when the chosen copy turns out damaged.

- A local step whose bytes fail their digests (the listing judges by sizes) is first
  repaired: the damaged copies the errors lead to are replaced by other nodes' good copies,
  or rebuilt from parity when no node holds one (``repair.py``, ``mend.py``), and the step
  is read again. One that cannot be repaired falls back, when
  the newest was asked for, to the next older step whole locally (unless the persistent root
  holds a newer one), then to the persistent root's newest step, with a warning.
- A persistent restore that fell back below the newest step whole locally (the persistent
  root's newest was damaged) restores that local step instead.
- After restoring the newest, each node drops its local steps newer than the one restored
  that no tier holds whole, and every rank waits for that before it returns; the coordinator
  takes over the step claims above the step restored (``commit/claim.py``), also when nothing was
  found to restore; and damaged steps the persistent restore quarantined there
  (``lifecycle/quarantine.py``) count as not persisted, so that the save of such a step is uploaded.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardkeeper.core.restore.request import RestoreRequest
from shardkeeper.core.restore.restorer import Restorer
from shardkeeper.core.tiers.choose import LOCAL, PERSISTENT, Choice
from shardkeeper.core.tiers.repair import damaged_files
from shardkeeper.core.tiers.tiering import Tiering
from shardkeeper.core.tiers.wire import TierGroupBroken

log = logging.getLogger(__name__)

#: Times one local step is repaired and read again (a restore names one damaged file per rank
#: and attempt) before it counts as damaged.
MAX_REPAIRS = 3


@dataclass
class Restored:
    step: int
    tier: str
    restorer: Restorer


def _damage_code(e: BaseException) -> int:
    """0: this rank succeeded (another failed), 1: the step is damaged, 2: anything else."""
    if getattr(e, "on_other_rank", False):
        return 0
    return 1 if isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)) else 2


def restore_tiered(
    tiers: Tiering,
    local: Restorer,
    remote: Restorer,
    state: Mapping[str, Any],
    request: RestoreRequest,
    uploads: Any = None,
) -> Restored:
    """Collective: restore ``state`` from the tiers (``local`` / ``remote``: the restorers of
    this node's directory and of the persistent root; ``uploads``: where the uploads run, told
    of the steps the restore quarantined, ``Tiering.forget_persisted``)."""
    rank, step = tiers.rank, request.step
    choice = tiers.choose(step)
    if choice.tier is None:
        if step is None:
            tiers.take_over(None)  # a job that starts over takes over what a dead one claimed
        where = f"the local tier ({tiers.local.raw.url} and the other nodes' directories) or {tiers.persistent.raw.url}"
        lost = "".join(f" ({note})" for note in choice.lost_beyond_parity)
        raise CheckpointNotFoundError(
            f"no {'committed checkpoint' if step is None else f'step {step}'} is whole in {where} (rank {rank}){lost}; "
            f"nothing to restore. Check the roots, or start training from scratch"
        )
    if choice.tier == LOCAL:
        assert choice.step is not None
        out = _local_with_fallback(tiers, local, remote, state, request, choice)
    else:
        out = Restored(remote.restore_state(state, request.at(choice.step)), PERSISTENT, remote)
        newest_local = choice.local_steps[0] if choice.local_steps else None
        if step is None and newest_local is not None and out.step < newest_local:
            warnings.warn(
                f"the persistent root's newer steps are damaged (restored step {out.step} there); restoring step "
                f"{newest_local}, whole in the local tier, instead",
                stacklevel=4,
            )
            tiers.make_whole(choice, newest_local)
            out = _restore_repairing(tiers, local, state, request, newest_local)
    if step is None:
        tiers.drop_newer(choice, out.step)
        tiers.take_over(out.step)
        tiers.forget_persisted(remote.quarantined, uploads)
    return out


def _local_with_fallback(
    tiers: Tiering,
    local: Restorer,
    remote: Restorer,
    state: Mapping[str, Any],
    request: RestoreRequest,
    choice: Choice,
) -> Restored:
    """The chosen local step; when its bytes fail their digests (the ranks agree) and the
    newest was asked for, the next older step whole locally unless the persistent root holds
    a newer one, then the persistent root's newest. A damaged step leaves
    ``choice.local_steps``, so the drop after the restore removes it from every node (else
    every restart would try it again, and a save below it would be refused)."""
    assert choice.step is not None
    step = request.step
    candidates: list[int] = [choice.step] if step is not None else list(choice.local_steps)
    newest_persisted = choice.persisted[-1] if choice.persisted else None
    for i, s in enumerate(candidates):
        if i and newest_persisted is not None and newest_persisted > s:
            break  # the persistent root holds a newer step than the next local one
        if i:
            tiers.make_whole(choice, s)
        try:
            return _restore_repairing(tiers, local, state, request, s)
        except Exception as e:  # (agreed on by every rank before it was raised)
            if getattr(e, "tier_damage", None) != 1 or step is not None:
                raise
            choice.local_steps.remove(s)
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            if nxt is not None and (newest_persisted is None or nxt >= newest_persisted):
                later: str | None = f"step {nxt} of the local tier"
            else:
                later = "the persistent root's newest step" if choice.persisted else None
            if later is None:
                raise
            note = getattr(e, "partly_restored_note", "")  # (the restore that follows rewrites the target)
            why = str(e).replace(note, "") if note else str(e)
            warnings.warn(f"step {s} in the local tier is damaged ({why}); restoring {later}", stacklevel=5)
    return Restored(remote.restore_state(state, request.at(None)), PERSISTENT, remote)


def _restore_repairing(
    tiers: Tiering,
    local: Restorer,
    state: Mapping[str, Any],
    request: RestoreRequest,
    s: int,
) -> Restored:
    """``request`` at local step ``s``; when its bytes fail their digests, the damaged copies
    the ranks' errors lead to are replaced by other nodes' good copies (``repair.py``) and
    ``s`` is read again, up to ``MAX_REPAIRS`` times. A failure is raised on every rank
    together, carrying the ranks' agreed verdict as ``tier_damage`` (1: the step is damaged,
    2: anything else, for which no other step is tried), also when nothing could be repaired
    or the repair itself failed (the step then counts as damaged)."""
    rank = tiers.rank
    for attempt in range(MAX_REPAIRS + 1):
        try:
            return Restored(local.restore_state(state, request.at(s, agreed=True)), LOCAL, local)
        except Exception as e:  # every rank agrees on what failed, so none waits on another
            code = tiers.group.all_reduce_max([_damage_code(e)], f"rank {rank}: whether step {s} is damaged")[0]
            e.tier_damage = code  # type: ignore[attr-defined]
            if code != 1 or attempt == MAX_REPAIRS:
                raise
            try:
                repaired = tiers.repair(s, damaged_files(e))
            except TierGroupBroken:
                raise
            except CheckpointError as failed:  # (agreed inside the repair: every rank is here)
                log.warning("rank %d: step %d: repairing its damaged copies failed (%s)", rank, s, failed)
                repaired = []
            if not repaired:
                raise
            shown = "; ".join(r.shown() for r in repaired[:4])
            warnings.warn(
                f"step {s} in the local tier: {len(repaired)} damaged cop{'y' if len(repaired) == 1 else 'ies'} "
                f"replaced by other nodes' good copies or rebuilt from parity ({shown}"
                f"{' ...' if len(repaired) > 4 else ''}); restoring step {s} again",
                stacklevel=6,
            )
    raise AssertionError("unreachable")


__all__ = ["Restored", "restore_tiered"]
