"""``ResumableDistributedSampler``: DistributedSampler's order, with a position that holds at
any world size (docs/data.md).

The position is one count: how many samples of the epoch's global order were consumed, by all
ranks together. The ranks take the order in turn (``order.py``), so while they step together
the consumed samples are a prefix of the order, ``consumed = start + world * k`` after each
rank consumed ``k`` in this pass; a resume at another world size deals out the rest. The state
is the same on every rank: the manager saves it once (rank 0's copy), as any replicated JSON
value, in about 200 bytes of the manifest; its keys are every adapter's (``position.py``).

What the training loop consumed is not what the sampler yielded: a ``DataLoader`` with workers
draws ``prefetch_factor * num_workers`` batches of indices ahead of the loop, so a count of
yielded indices runs ahead, and a resume from it would skip the prefetched batches. So by
default (``count="advanced"``) the loop reports what it consumed, ``sampler.advance(n)`` per
batch (a framework's adapter would do it in its loop); ``count="yielded"`` counts the indices
yielded instead, which is exact only where indices are drawn as the loop consumes them
(``DataLoader(num_workers=0)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardkeeper.core.data.order import epoch_order, part_length, rank_part
from shardkeeper.core.data.position import DISTRIBUTED_ORDER, KEYS, count_problems
from shardkeeper.core.errors import StateMismatchError

#: The version of the state's layout, and the padding policy it records: the order's first
#: samples, as DistributedSampler pads.
_VERSION = 1
_PADDING = "head"
_COUNTS = ("advanced", "yielded")


class ResumableDistributedSampler(torch.utils.data.DistributedSampler[int]):
    """A drop-in for ``torch.utils.data.DistributedSampler`` whose ``state_dict()`` resumes
    the epoch at any world size, every sample of it seen once.

    It yields what DistributedSampler yields (same arguments, ``set_epoch``, ``len``), and
    ``mgr.save(step, {..., "sampler": sampler})`` records where the epoch stands: the epoch,
    the number of samples of its order consumed, and what the order depends on (seed, shuffle,
    dataset length, ``drop_last``, padding). After ``mgr.restore({..., "sampler": sampler})``
    at any world size, the next pass yields this rank's part of the rest of that epoch;
    ``set_epoch`` to another epoch starts that one from its beginning.

    ``count`` says where the consumed count comes from (module docstring): ``"advanced"``
    (default) what ``advance(n)`` reported, exact whatever the DataLoader prefetches;
    ``"yielded"``, the indices this rank's iterator yielded, exact with ``num_workers=0``.
    Either way the count is per rank and the ranks must step together (DDP's lockstep): the
    checkpoint holds rank 0's.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        count: str = "advanced",
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                f"ResumableDistributedSampler takes a map-style dataset (with __len__ and "
                f"__getitem__), not an IterableDataset ({type(dataset).__name__}): a stream has "
                f"no sampler, its position is inside each worker's iterator. Use a map-style "
                f"dataset, or keep the stream's own state per rank (torchdata's "
                f"StatefulDataLoader, PerRank(loader.state_dict())); docs/data.md, 'Iterable "
                f"datasets and worker processes'"
            )
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        if count not in _COUNTS:
            raise ValueError(f"count must be one of {_COUNTS}, got {count!r}")
        self.count = count
        self._start = 0  # samples of the epoch's order consumed before the current pass
        self._yielded = 0  # this rank's indices yielded in the current pass
        self._advanced = 0  # this rank's samples reported consumed in the current pass
        self._ended = False  # the current pass yielded all it had
        self._pass = 0  # the current pass's number: an older iterator no longer counts
        self._reported = False  # advance() was called at least once
        self._warned = False

    # -- DistributedSampler's interface ---------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        if self._ended:  # iterated again in the same epoch: the whole epoch, as DistributedSampler
            self._start = 0
        self._new_pass()
        order = epoch_order(self._n(), shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        mine = rank_part(order, self._start, world=self.num_replicas, rank=self.rank, drop_last=self.drop_last)
        return self._walk(mine, self._pass)

    def __len__(self) -> int:
        """The number of indices this rank's current (or next) pass yields: DistributedSampler's
        ``num_samples`` from an epoch's beginning, less after a resume mid-epoch."""
        return part_length(self._n(), self._start, world=self.num_replicas, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler's; another epoch than the current one starts at its beginning,
        the current one (as restored) stays where it stands."""
        if epoch != self.epoch:
            self._start = 0
            self._new_pass()
        super().set_epoch(epoch)

    # -- the position ---------------------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Report ``n`` more samples consumed by the training loop on this rank (its batch's
        length), once per batch, on every rank. Capped at what this pass has yielded, so a
        short last batch may be reported at the full batch size."""
        if self.count != "advanced":
            raise ValueError(
                f"advance() counts consumed samples for count='advanced'; this sampler has "
                f"count={self.count!r}, which counts the indices it yields by itself"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypeError(f"advance(n): n is a number of samples, an int >= 0, got {n!r}")
        self._reported = True
        self._advanced = min(self._advanced + n, self._yielded)

    @property
    def consumed(self) -> int:
        """Samples of the current epoch's order consumed so far, by all ranks together."""
        per_rank = self._advanced if self.count == "advanced" else self._yielded
        return min(self._start + self.num_replicas * per_rank, self._n())

    def state_dict(self) -> dict[str, Any]:
        """The position, the same on every rank that stepped with the others (JSON values)."""
        if self.count == "advanced" and self._yielded and not self._reported and not self._warned:
            self._warned = True
            warnings.warn(
                f"ResumableDistributedSampler (rank {self.rank}) has yielded {self._yielded} "
                f"indices this pass but advance() was never called: the position records none "
                f"of them consumed, and a resume would see them again. Call "
                f"sampler.advance(len(batch)) after each batch, or construct it with "
                f"count='yielded' if the DataLoader has num_workers=0",
                RuntimeWarning,
                stacklevel=2,
            )
        return self._state()

    def _state(self) -> dict[str, Any]:
        """``state_dict()`` without its warning (also what ``load_state_dict`` compares with)."""
        return {
            "version": _VERSION,
            "epoch": int(self.epoch),
            "consumed": self.consumed,
            "dataset_len": self._n(),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "padding": _PADDING,
            "order": DISTRIBUTED_ORDER,
            "world": int(self.num_replicas),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the saved epoch where it stood; the next pass yields this rank's part of the
        rest. Refused when the order would differ (seed, shuffle, dataset length, an order this
        sampler cannot draw) or the saved run dropped or padded differently."""
        if not isinstance(state, Mapping):
            raise StateMismatchError(
                f"ResumableDistributedSampler (rank {self.rank}): not a sampler position but a "
                f"{type(state).__name__}; was another object saved under this key?"
            )
        missing = [k for k in KEYS if k not in state]
        if missing or state["version"] != _VERSION:
            raise StateMismatchError(
                f"ResumableDistributedSampler (rank {self.rank}): not a sampler position of "
                f"version {_VERSION} (missing {missing}, version {state.get('version')!r}); was "
                f"another object saved under this key?"
            )
        if state["order"] != DISTRIBUTED_ORDER:
            raise StateMismatchError(
                f"ResumableDistributedSampler (rank {self.rank}): the checkpoint's data position is "
                f"in an order of another sampler ({state['order']!r}, not DistributedSampler's "
                f"seed + epoch), which this sampler cannot draw: resuming it would see samples "
                f"twice or never. Resume under the framework that saved it, save it with a seeded "
                f"order (Accelerate: DataLoaderConfiguration(use_seedable_sampler=True)), or leave "
                f"the position out of the restore to start the epoch afresh"
            )
        now = self._state()
        compared = ("dataset_len", "shuffle", "drop_last", "padding") + (("seed",) if now["shuffle"] else ())
        differ = [f"{k}: saved {state.get(k)!r}, now {now[k]!r}" for k in compared if state.get(k) != now[k]]
        if differ:
            raise StateMismatchError(
                f"ResumableDistributedSampler (rank {self.rank}): the checkpoint's data position "
                f"belongs to another order ({'; '.join(differ)}), so resuming it would see samples "
                f"twice or never; construct the sampler as the saved run did, or leave the "
                f"sampler out of the restore to start the epoch afresh"
            )
        epoch, consumed = state["epoch"], state["consumed"]
        bad = count_problems(state, self._n())
        if bad:
            raise StateMismatchError(
                f"ResumableDistributedSampler (rank {self.rank}): the saved position's "
                f"{' and '.join(bad)} (dataset length {self._n()}); the position was damaged or "
                f"edited. Restore another step, or leave the sampler out of the restore to start "
                f"the epoch afresh"
            )
        super().set_epoch(epoch)
        self._start = consumed
        self._new_pass()

    # -- internals ------------------------------------------------------------------------------
    def _n(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a map-style dataset has a length

    def _new_pass(self) -> None:
        self._pass += 1
        self._yielded = self._advanced = 0
        self._ended = False

    def _walk(self, indices: list[int], token: int) -> Iterator[int]:
        for i in indices:
            if token == self._pass:
                self._yielded += 1
            yield i
        if token == self._pass:
            self._ended = True


__all__ = ["ResumableDistributedSampler"]
