"""Per-rank state (``PerRank`` values, ``RNGState``) restored at another world size than the
save's: which saved rank's state each rank reads (the ``per_rank`` policy), and the one
warning that says what was mapped.

Policies (docs/protocol.md, "Per-rank state at another world size"):

- ``map`` (the default): rank r reads saved rank r's state when the saving run had a rank r;
  a rank it did not have keeps its own (what its program's seeding made it, as in a fresh
  run), never a copy of another rank's; the state of saved ranks the run no longer has is
  not used. Rank 0 warns once.
- ``exact``: refuse, before anything is read.
- ``modulo``: rank r reads saved rank ``r % saved``'s (ranks may share one state).
- ``drop``: every rank keeps its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.manifest import Manifest

PER_RANK_POLICIES = ("map", "exact", "modulo", "drop")

#: Where a plain-torch user sets the policy; an adapter's manager names its own call
#: (``CheckpointManager.per_rank_call``, set through ``adapter.RootManagers``).
PLAIN_CALL = "CheckpointManager(root, per_rank=...) or mgr.restore(..., per_rank=...)"


class WorldSizeChangedWarning(UserWarning):
    """A restore at another world size than the save's mapped per-rank state (``per_rank``)."""


def source_key(
    prefix: str | None, key: str, rank: int, saved_world: int, world: int, policy: str, where: str, call: str
) -> str | None:
    """The saved key a target leaf under per-rank ``prefix`` (None: not per-rank) reads, by
    ``policy``; None: it keeps its value. ``call`` names where the user sets the policy."""
    if prefix is None or saved_world == world:
        return key
    rest = key[len(f"{prefix}/{rank}") :]
    if policy == "map":
        return key if rank < saved_world else None
    if policy == "modulo":
        return f"{prefix}/{rank % saved_world}{rest}"
    if policy == "drop":
        return None
    raise StateMismatchError(
        f"per-rank state {prefix!r} of {where} was saved at world size {saved_world}, restoring at "
        f"{world}, and per_rank='exact' refuses a change of world size. Set per_rank in {call}: "
        f"'map' (the default: rank r takes saved rank r's state, a rank the saving run did not have "
        f"keeps its own), 'modulo' (rank r takes saved rank r % {saved_world}'s) or 'drop' (every "
        f"rank keeps its own); or resume at world size {saved_world}"
    )


def _ranks(lo: int, hi: int) -> str:
    """``rank 3`` or ``ranks 2-5`` (``lo`` <= ``hi``)."""
    return f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"


def world_change_note(
    prefixes: Sequence[str], *, step: int, root: str, saved_world: int, world: int, policy: str, call: str
) -> str:
    """The warning of a restore of ``prefixes`` (per-rank state) saved at ``saved_world`` ranks
    into ``world``: what each rank got, by ``policy``."""
    names = ", ".join(repr(p) for p in prefixes)
    common = min(saved_world, world)
    if policy == "map":
        how = [f"{_ranks(0, common - 1)} took the saved state of the same rank"]
        if world > saved_world:
            how.append(f"{_ranks(saved_world, world - 1)} kept their own (the saving run had no such rank)")
        else:
            how.append(f"the saved state of {_ranks(world, saved_world - 1)} is not used")
    elif policy == "modulo":
        how = [f"rank r took saved rank r % {saved_world}'s"]
    else:
        how = ["every rank kept its own (per_rank='drop')"]
    return (
        f"step {step} under {root} was saved at world size {saved_world} and is restored at world size "
        f"{world}: per-rank state {names}: {'; '.join(how)}. Model, optimizer and other shared state "
        f"are resharded exactly, and so is a data position that shardkeeper's samplers or an adapter "
        f"saved (docs/data.md). Random streams (dropout, sampling) and data positions kept per rank do "
        f"not continue the saved run's exactly; per_rank='exact' (in {call}) refuses a change of world "
        f"size instead"
    )


def warn_world_change(
    per_rank_prefixes: Sequence[str],
    touched: set[str],
    manifest: Manifest,
    rank: int,
    world: int,
    root: str,
    policy: str,
    call: str,
) -> None:
    """The one warning (on rank 0) of a restore of ``manifest`` at another world size than its
    save's that touched (restored or dropped) per-rank state."""
    if rank != 0 or manifest.world_size == world:
        return
    prefixes = [p for p in per_rank_prefixes if any(k.startswith(p + "/") for k in touched)]
    if prefixes:
        text = world_change_note(
            prefixes,
            step=manifest.step,
            root=root,
            saved_world=manifest.world_size,
            world=world,
            policy=policy,
            call=call,
        )
        warnings.warn(text, WorldSizeChangedWarning, stacklevel=4)


__all__ = [
    "PER_RANK_POLICIES",
    "PLAIN_CALL",
    "WorldSizeChangedWarning",
    "source_key",
    "warn_world_change",
    "world_change_note",
]
