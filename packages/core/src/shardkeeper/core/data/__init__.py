"""Data position: where an epoch stands, recorded so that a resume at any world size sees
every sample of the epoch once (docs/data.md).

``sampler.py`` holds ``ResumableDistributedSampler``, exported as
``shardkeeper.core.ResumableDistributedSampler``; ``order.py`` computes an epoch's global order
and one rank's part of what remains of it.
"""

__all__: list[str] = []
