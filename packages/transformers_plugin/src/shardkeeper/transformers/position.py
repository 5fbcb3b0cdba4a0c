"""The Trainer's data position at any world size (docs/transformers.md, "The data position").

The Trainer samples with a ``RandomSampler`` (or ``SequentialSampler``) that Accelerate shards
by batches, and on resume skips the first ``global_step % steps_per_epoch`` batches of the
epoch: right only at the world size of the save. Where the Trainer builds its own sampler
(``train_sampling_strategy`` ``"random"`` or ``"sequential"``, ``_get_train_sampler`` not
overridden, a dataset with a length), ``enable()`` gives it the core's
``ResumableDistributedSampler`` instead: rank-aware, so Accelerate's batch sharding is made a
passthrough, as the Trainer does for its own rank-aware ``BatchRebalanceSampler``. Each
optimizer step reports its samples consumed (a callback's ``on_step_end``), the position is
saved as ``extra/data_position/0/...`` (replicated, about 200 bytes; the key and layout of every
adapter, so another framework resumes it), and a resume positions the
sampler and starts the epoch loop at its epoch: the rest of the epoch is split across the new
ranks (``Position.resumed``). Any other sampler keeps the Trainer's behaviour, with a warning.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.data import IterableDataset

from shardkeeper.core import ResumableDistributedSampler
from shardkeeper.core.adapter import DATA_POSITION_KEY
from shardkeeper.transformers import _internals as tfi

log = logging.getLogger(__name__)

#: Where the position is saved: ``extra/data_position/0/epoch``, ``.../consumed``, ... (the
#: Trainer has one train loader, the first).
KEY = DATA_POSITION_KEY + "/0"
#: The Trainer's own samplers this adapter replaces, by ``train_sampling_strategy``.
STRATEGIES = {"random": True, "sequential": False}  # shuffle


class Position:
    """The sampler the Trainer's train loader uses, when it is this adapter's, and its resume."""

    def __init__(self) -> None:
        self.sampler: ResumableDistributedSampler | None = None
        self.batches: Any = None  # the loader's BatchSampler over ``sampler``
        self.per_step = 0  # samples a rank consumes per optimizer step
        self.keep_own = ""  # why this run keeps the Trainer's own sampler (a resume without a position)
        self.rng_at_first_step = False  # the resumed step's RNG waits for the first batch
        self.skipped = 0  # samples of the batches the Trainer skipped, not yet counted
        self.restore_rng: Callable[[], None] | None = None
        self._warned = False

    # -- building -------------------------------------------------------------------------------
    def begin(self, keep_own: str) -> None:
        """A ``train()`` call starts; ``keep_own``: why it keeps the Trainer's own sampler ("": it need not)."""
        self.sampler = self.batches = None
        self.keep_own = keep_own
        self.rng_at_first_step = False
        self.skipped = 0

    def train_sampler(self, tr: Any, own: Callable[..., Any], train_dataset: Any = None) -> Any:
        """``_get_train_sampler``: this adapter's sampler where the Trainer builds its own."""
        from transformers.trainer_utils import has_length

        dataset: Any = tr.train_dataset if train_dataset is None else train_dataset
        strategy = tr.args.train_sampling_strategy
        if not tfi.builds_own_train_sampler(type(tr)):
            why = f"{type(tr).__name__}._get_train_sampler builds it"
        elif strategy not in STRATEGIES:
            why = f"train_sampling_strategy={strategy!r}"
        elif self.keep_own:
            why = self.keep_own
        else:
            why = ""
        sized = dataset is not None and has_length(dataset)
        if why or not sized:
            sampler = own(tr, train_dataset)
            if why and sampler is not None:
                self.warn_own(tr, f"{type(sampler).__name__} ({why})")
            return sampler
        world = max(1, int(tr.args.world_size))
        seed = tr.args.data_seed if tr.args.data_seed is not None else tr.args.seed
        return ResumableDistributedSampler(
            dataset,
            num_replicas=world,
            rank=int(tr.args.process_index) if world > 1 else 0,
            shuffle=STRATEGIES[strategy],
            seed=int(seed),
        )

    def attach(self, tr: Any, loader: Any) -> Any:
        """``get_train_dataloader``'s loader: where its sampler is this adapter's, Accelerate's
        batch sharding becomes a passthrough (the sampler gives each rank its own part) and the
        position follows this loader; else the Trainer's behaviour, with a warning."""
        shard: Any = getattr(loader, "batch_sampler", None)
        batches: Any = getattr(shard, "batch_sampler", shard)  # accelerate's BatchSamplerShard wraps it
        sampler = getattr(batches, "sampler", None)
        if not isinstance(sampler, ResumableDistributedSampler):
            self.sampler = self.batches = None
            iterable = isinstance(getattr(loader, "dataset", None), IterableDataset)  # no sampler to give
            if not self.keep_own and sampler is not None and not iterable:
                self.warn_own(tr, f"{type(sampler).__name__} (the train loader is not the Trainer's own)")
            return loader
        if shard is not batches:  # as the Trainer neutralises it for its BatchRebalanceSampler
            shard.num_processes, shard.process_index = 1, 0
            shard.even_batches = False  # no padding of a short last batch: DistributedSampler pads
        self.sampler, self.batches = sampler, batches
        self.per_step = int(batches.batch_size) * int(tr.args.gradient_accumulation_steps)
        return loader

    def warn_own(self, tr: Any, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"shardkeeper.transformers: the Trainer's train sampler is {what}, not the world-size "
            f"independent one shardkeeper gives the Trainer's own (rank {tr.args.process_index}). The data "
            f"position is the Trainer's: a resume skips global_step's batches of the epoch, which is exact at "
            f"the world size of the save only; at another one, samples of the interrupted epoch are seen twice "
            f"or never. Resume mid-epoch at the same world size, or let the Trainer build its sampler "
            f"(train_sampling_strategy 'random' or 'sequential', no _get_train_sampler override)",
            UserWarning,
            stacklevel=2,
        )

    # -- saving and resuming ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The position alone, as the saved state holds it (none when the sampler is not ours)."""
        return {} if self.sampler is None else {"extra": {"data_position": {"0": self.sampler}}}

    def add_to(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (``build_state``'s) with the position in it, beside ``extra/grad_scaler``."""
        if self.sampler is not None:
            state["extra"] = {**state.get("extra", {}), **self.state()["extra"]}
        return state

    def step_done(self) -> None:
        """An optimizer step consumed ``per_step`` samples on this rank (capped at what the
        loader drew: a short last batch or accumulation), after the batches the Trainer skipped."""
        if self.sampler is not None:
            self.sampler.advance(self.per_step + self.skipped)
            self.skipped = 0

    def resumed(self) -> tuple[int, int]:
        """After the sampler's position was restored: the epoch the Trainer's loop starts at and
        the batches it skips. None left at this world size: the next epoch. Consumed samples that
        are whole optimizer steps at this world size, batch size and accumulation (always so when
        none changed): the sampler starts the epoch over and the Trainer skips those batches as
        it does on its own (its step count, RNG restore and epoch end unchanged), the same
        samples as the position's rest. Otherwise the sampler yields the rest from the position,
        nothing is skipped, and the step's RNG is restored at the first batch, as after a skip
        (a skip of a part of a step would leave a partial first step and shift the epoch's steps,
        so a run counted in epochs would reach ``max_steps`` with batches untrained)."""
        assert self.sampler is not None
        s, batch = self.sampler, int(self.batches.batch_size)
        epoch, consumed = int(s.epoch), s.consumed
        if len(self.batches) == 0:
            return epoch + 1, 0
        steps, rest = divmod(consumed, s.num_replicas * self.per_step)
        if rest:
            self.rng_at_first_step = True
            return epoch, 0
        s.load_state_dict({**s.state_dict(), "consumed": 0})
        self.skipped = steps * self.per_step  # this rank's, counted at the first step
        return epoch, steps * self.per_step // batch

    def warn_if_cut(self, tr: Any, max_steps: int, per_epoch: int, epochs: Any, done: int, skip: int) -> None:
        """After ``resumed()``: warn when a run counted in epochs (no ``args.max_steps``) reaches
        ``max_steps`` before its data ends. ``global_step`` resumes in the saved run's steps, so
        at a larger global batch the rest needs more steps than ``max_steps`` leaves."""
        if self.sampler is None or int(tr.args.max_steps) > 0:
            return
        ga = max(1, int(tr.args.gradient_accumulation_steps))
        if done == int(self.sampler.epoch):  # the resumed epoch's rest, then the epochs after it
            left = max(0, len(self.batches) - skip)
            needed = -(-left // ga) + max(0, math.ceil(float(epochs)) - done - 1) * per_epoch
        else:  # nothing left of it: the epochs from ``done``
            needed = max(0, math.ceil(float(epochs)) - done) * per_epoch
        gs = int(tr.state.global_step)
        if gs + needed <= max_steps:
            return
        warnings.warn(
            f"shardkeeper.transformers: the resumed run reaches max_steps {max_steps} at step "
            f"{max_steps} (rank {tr.args.process_index}) with {gs + needed - max_steps} optimizer "
            f"step(s) of data untrained: global_step resumes at {gs}, counted in the saved run's "
            f"steps, and the rest of its {epochs} epoch(s) needs {needed} steps of this run's global "
            f"batch (world size x per-device batch x gradient accumulation). Give "
            f"max_steps={gs + needed} (or more num_train_epochs) to train on all of it",
            UserWarning,
            stacklevel=2,
        )

    def first_step(self) -> None:
        """The first batch of a mid-epoch resume is drawn: restore the step's RNG now."""
        if self.rng_at_first_step and self.restore_rng is not None:
            self.rng_at_first_step = False
            self.restore_rng()


def callback(position: Position) -> Any:
    """The ``TrainerCallback`` that reports each optimizer step to ``position`` and restores a
    mid-epoch resume's RNG at its first batch."""
    from transformers import TrainerCallback

    class DataPositionCallback(TrainerCallback):
        """shardkeeper's data position: the samples each optimizer step consumed."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            position.first_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            position.step_done()

    return DataPositionCallback()


__all__ = ["KEY", "Position", "STRATEGIES", "callback"]
