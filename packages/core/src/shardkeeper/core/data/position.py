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

#: Where the positions are in a checkpoint: ``<DATA_POSITION_KEY>/<i>/<key>``.
DATA_POSITION_KEY = "extra/data_position"
#: The order any reader can compute: DistributedSampler's.
DISTRIBUTED_ORDER = "distributed"
#: The keys of one position, whoever wrote it.
KEYS = ("version", "epoch", "consumed", "dataset_len", "seed", "shuffle", "drop_last", "padding", "order", "world")


__all__ = ["DATA_POSITION_KEY", "DISTRIBUTED_ORDER", "KEYS"]
