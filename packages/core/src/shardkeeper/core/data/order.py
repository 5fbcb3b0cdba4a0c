"""An epoch's global order, and one rank's part of what remains of it after ``consumed`` samples.

The order is ``torch.utils.data.DistributedSampler``'s: ``torch.randperm(n)`` drawn from a
generator seeded with ``seed + epoch`` (or ``range(n)`` unshuffled). What remains after the
first ``consumed`` samples is split as DistributedSampler splits a whole epoch: padded at the
end with the order's first samples (repeated when fewer than the padding) up to a multiple of
the world size, or cut down to one (``drop_last``), then dealt out in turn, rank ``r`` taking
positions ``r, r + world, r + 2 world, ...``. Dealt out that way, once every rank has taken
``k`` samples the samples taken are exactly the first ``k * world`` remaining ones: a prefix of
the order, which a single count records whatever the world size. With ``consumed = 0`` this is
DistributedSampler's own split, index for index.
"""

from __future__ import annotations

import math

import torch

#: The largest seed a torch generator takes: ``seed + epoch`` of a shuffled order is at most this.
MAX_SEED = 2**64 - 1


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's order of the ``n`` samples: DistributedSampler's, bit for bit."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def part_length(n: int, consumed: int, *, world: int, drop_last: bool) -> int:
    """How many samples each of ``world`` ranks takes from what remains after ``consumed``."""
    left = n - min(consumed, n)
    return left // world if drop_last else math.ceil(left / world)


def rank_part(order: list[int], consumed: int, *, world: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s samples (of ``world``) of what remains of ``order`` after ``consumed``."""
    n = len(order)
    per_rank = part_length(n, consumed, world=world, drop_last=drop_last)
    rest = order[min(consumed, n) :]
    total = per_rank * world
    if total > len(rest):  # padding: the order's first samples, as DistributedSampler pads
        rest += [order[i % n] for i in range(total - len(rest))]
    return rest[rank:total:world]


__all__ = ["MAX_SEED", "epoch_order", "part_length", "rank_part"]
