"""``RestoreRequest``: one ``CheckpointManager.restore`` call, its arguments checked once and
passed whole to the restore (``restore/restorer.py``) and the tiers' (``tiers/restore.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core.config.arguments import check_step
from shardkeeper.core.restore.per_rank import PER_RANK_POLICIES, PLAIN_CALL


def _patterns(value: str | Sequence[str] | None) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value or ())


@dataclass(frozen=True)
class RestoreRequest:
    """What to restore: ``step`` (None: the newest committed), ``patterns`` (``only=``; None:
    every key), ``strict``, ``per_rank`` (the policy, resolved), ``cast`` (``cast_dtypes=``),
    ``optional`` (patterns of target keys the checkpoint may lack), ``agreed``: the ranks
    already agreed on ``step`` (a tiered restore chose it together), and ``per_rank_call``:
    where the user sets ``per_rank`` (an adapter's call), for messages."""

    step: int | None
    patterns: tuple[str, ...] | None
    strict: bool
    per_rank: str
    cast: bool
    optional: tuple[str, ...]
    agreed: bool = False
    per_rank_call: str = PLAIN_CALL

    @classmethod
    def checked(
        cls,
        step: Any,
        only: str | Sequence[str] | None,
        *,
        strict: bool,
        per_rank: str | None,
        cast_dtypes: bool,
        optional: str | Sequence[str] | None,
        default_per_rank: str,
        per_rank_call: str = PLAIN_CALL,
    ) -> RestoreRequest:
        """``restore()``'s arguments checked (``step``: ``check_step``; ``per_rank``: one of
        ``PER_RANK_POLICIES``, None for ``default_per_rank``, the manager's option)."""
        step = check_step("restore", step, optional=True)
        policy = per_rank or default_per_rank
        if policy not in PER_RANK_POLICIES:
            raise ValueError(
                f"per_rank={policy!r}; choose one of {', '.join(PER_RANK_POLICIES)} (set it in {per_rank_call})"
            )
        patterns = _patterns(only) or None
        return cls(step, patterns, strict, policy, cast_dtypes, _patterns(optional), per_rank_call=per_rank_call)

    def at(self, step: int | None, *, agreed: bool = False) -> RestoreRequest:
        """The same request for ``step`` (``agreed``: the ranks chose it together)."""
        return dataclasses.replace(self, step=step, agreed=agreed)


__all__ = ["RestoreRequest"]
