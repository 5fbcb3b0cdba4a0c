"""Where a checkpoint holds the train data's position, and its layout: one for every writer, so a
run saved under one framework resumes its epoch under another (docs/data.md, "The layout").

A position is replicated state under ``extra/data_position/<i>/...`` (``i``: the train loader's
index, ``0`` for one loader), written once (rank 0's copy) by ``ResumableDistributedSampler``
(through the Lightning and Trainer adapters, or a plain loop that follows the convention) and
by the Accelerate adapter. A plain loop puts its sampler there as
``{"extra": {"data_position": {"0": sampler}}}`` in the state it saves and restores. Its keys (``KEYS``) are the same whoever wrote it:

- ``version`` (1), ``epoch``, ``consumed`` (samples of the epoch's order consumed by all ranks
  together), ``dataset_len``, ``seed``, ``shuffle``, ``drop_last``, ``padding`` (``"head"``);
- ``order``: what the epoch's order is. ``"distributed"``: ``DistributedSampler``'s, drawn from
  ``seed + epoch`` (``range(n)`` unshuffled), which any reader can compute. ``"generator"``: a
  ``randperm`` drawn from a generator whose state the writer keeps beside it (``generator``, a
  tensor); ``"sampler:<class>"``: a sampler of the user's own. Only the writer's framework can
  give those two back; ``ResumableDistributedSampler`` refuses them;
- ``world``: the world size at the save (informative: the position does not depend on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkeeper.core.data.order import MAX_SEED

#: Where the positions are in a checkpoint: ``<DATA_POSITION_KEY>/<i>/<key>``.
DATA_POSITION_KEY = "extra/data_position"
#: The order any reader can compute: DistributedSampler's.
DISTRIBUTED_ORDER = "distributed"
#: The keys of one position, whoever wrote it.
KEYS = ("version", "epoch", "consumed", "dataset_len", "seed", "shuffle", "drop_last", "padding", "order", "world")


def count_problems(position: Mapping[str, Any], n: int) -> list[str]:
    """What makes a position's counts ones no run saved (a damaged or edited checkpoint), as
    phrases (``"consumed -6 is not an int within [0, 30]"``), or none: ``epoch`` an int >= 0
    (whose shuffled order's seed ``seed + epoch`` stays within the generator's range),
    ``consumed`` an int within ``[0, n]`` (``n``: the dataset's length), ``seed`` an int,
    ``dataset_len`` an int >= 0 (whether it is ``n`` is the reader's to say, with its remedy).
    Every reader checks them before it takes the rest of an epoch: a negative count would
    resume from the epoch's tail and skip the rest."""

    def within(value: Any, high: int | None) -> bool:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return ok and (high is None or value <= high)

    seed = position.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return [f"seed {seed!r} is not an int"]
    top = MAX_SEED - seed if position.get("shuffle") else None  # (the order's seed is seed + epoch)
    return [
        f"{name} {position.get(name)!r} is not {want}"
        for name, high, want in (
            ("epoch", top, f"an int within [0, {top}]" if top is not None else "an int >= 0"),
            ("consumed", n, f"an int within [0, {n}]"),
            ("dataset_len", None, "an int >= 0"),
        )
        if not within(position.get(name), high)
    ]


__all__ = ["DATA_POSITION_KEY", "DISTRIBUTED_ORDER", "KEYS", "count_problems"]
