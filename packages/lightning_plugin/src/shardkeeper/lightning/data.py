"""The train data's position, at any world size: the sampler the plugin puts where Lightning
puts its ``DistributedSampler`` (docs/data.md, "Lightning").

With ``use_distributed_sampler=True`` (the default), Lightning replaces a train DataLoader's
``RandomSampler`` / ``SequentialSampler`` by ``DistributedSampler(dataset, num_replicas, rank,
shuffle, seed)``. Under the plugin, that sampler is a :class:`LightningSampler` built with the
same arguments instead: a ``ResumableDistributedSampler`` (same order, index for index), which
the plugin advances by the loader's batch size before each training batch, saves once
(``extra/data_position/<i>/...``, rank 0's copy, the same on every rank: the key and layout of
every adapter, so another framework resumes it) and, on a resume, hands the epoch's rest to the
new ranks.

Lightning counts an epoch's batches against ``len(dataloader)``, fixed when the loader is set
up, and resumes mid-epoch at the number of batches it had taken. So the sampler's ``len`` is
the whole epoch's part at this world size (``DistributedSampler``'s), and on a resume the fit
loop's count of batches taken this epoch is set to that length less the batches still to come:
at another world size the epoch then ends when its last remaining batch is taken, and the next
epoch has the new size's length. Samplers the user set, and loaders without a ``batch_size``,
are left as they are, without a position.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from shardkeeper.core import ResumableDistributedSampler

log = logging.getLogger(__name__)

#: The fit loop's per-epoch batch counters (``batch_progress.current``) the resume sets.
_COUNTERS = ("ready", "started", "processed", "completed")


class LightningSampler(ResumableDistributedSampler):
    """The sampler the plugin puts in a train DataLoader in place of Lightning's
    ``DistributedSampler``; ``len`` is the whole epoch's part at this world size, as
    ``DistributedSampler``'s (what Lightning counts the epoch's batches by)."""

    def __init__(self, *args: Any, batch_size: int, loader_drop_last: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.loader_drop_last = loader_drop_last

    def __len__(self) -> int:
        return int(self.num_samples)

    def batches(self, samples: int) -> int:
        """How many batches the DataLoader makes of ``samples`` indices."""
        b = self.batch_size
        return samples // b if self.loader_drop_last else math.ceil(samples / b)

    def batches_left(self) -> int:
        """The batches the next pass yields (the rest of a resumed epoch, else a whole one)."""
        return self.batches(super().__len__())


def _flat(loaders: Any) -> list[Any]:
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, Mapping):
        return [dl for v in loaders.values() for dl in _flat(v)]
    if isinstance(loaders, Sequence) and not isinstance(loaders, (str, bytes)):
        return [dl for v in loaders for dl in _flat(v)]
    return []


def train_samplers(trainer: Any) -> list[LightningSampler]:
    """The plugin's samplers in the trainer's train DataLoaders, in Lightning's order."""
    if trainer is None:
        return []
    try:
        loaders = trainer.train_dataloader
    except Exception:  # noqa: BLE001 - not set up (no fit yet): no samplers
        return []
    return [dl.sampler for dl in _flat(loaders) if isinstance(dl.sampler, LightningSampler)]


class DataPositions:
    """The positions of the plugin's train samplers, as one replicated stateful object."""

    def __init__(self) -> None:
        self.trainer: Any = None  # the trainer whose train samplers are saved
        self._pending: dict[str, Any] = {}  # restored positions, by sampler index
        self._made = 0  # samplers made since the restore

    # -- save ----------------------------------------------------------------------------------
    def add_to(self, state: dict[str, Any], trainer: Any) -> None:
        """Put the positions in ``state`` for a save, as ``extra/data_position`` (none without samplers)."""
        self.trainer = trainer
        if train_samplers(trainer):
            state["extra"] = {**state.get("extra", {}), "data_position": self}

    def state_dict(self) -> dict[str, Any]:
        return {str(i): s.state_dict() for i, s in enumerate(train_samplers(self.trainer))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.resume(state)

    # -- resume --------------------------------------------------------------------------------
    def resume(self, saved: Mapping[str, Any] | None) -> None:
        """Keep the checkpoint's positions (``extra/data_position``, restored) for the samplers
        Lightning makes next, when it sets up the train data of the resumed fit."""
        self._pending = {str(k): dict(v) for k, v in (saved or {}).items() if isinstance(v, Mapping)}
        self._made = 0

    def advance(self, trainer: Any) -> None:
        """Before each training batch: every sampler of the batch's loaders took a batch."""
        for s in train_samplers(trainer):
            s.advance(s.batch_size)

    def replace(self, trainer: Any, dataloader: Any, sampler: Any, mode: Any) -> Any:
        """The sampler Lightning resolved for ``dataloader``: its ``DistributedSampler`` of a
        train loader becomes a :class:`LightningSampler` (at the restored position, if any)."""
        if getattr(mode, "value", mode) != "train" or type(sampler) is not DistributedSampler:
            return sampler
        if dataloader.batch_size is None:
            log.warning(
                "shardkeeper.lightning: the train DataLoader has its own batch_sampler, so its data "
                "position is not recorded (a resume mid-epoch restarts the epoch's data)"
            )
            return sampler
        new = LightningSampler(
            sampler.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            batch_size=int(dataloader.batch_size),
            loader_drop_last=bool(dataloader.drop_last),
        )
        saved = self._pending.pop(str(self._made), None)
        self._made += 1
        if saved is not None and int(saved.get("epoch", -1)) == int(trainer.current_epoch):
            new.load_state_dict(saved)
            _resume_batch_count(trainer, new)
        return new


def _resume_batch_count(trainer: Any, sampler: LightningSampler) -> None:
    """Set the fit loop's count of this epoch's batches taken to the epoch's length at this
    world size less the batches the resumed pass yields (unchanged at the same world size)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    taken = sampler.batches(len(sampler)) - sampler.batches_left()
    delta = taken - int(current.ready)
    for name in _COUNTERS:
        setattr(current, name, max(0, int(getattr(current, name)) + delta))


__all__ = ["DataPositions", "LightningSampler", "train_samplers"]
