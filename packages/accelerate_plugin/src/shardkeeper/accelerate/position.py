"""A prepared DataLoader's position at any world size, in the layout every adapter writes
(``extra/data_position/<i>/...``; docs/data.md, "The layout"), and the resumed pass that hands
the rest of the epoch to the ranks of this run.

Accelerate shards batches, not samples: every rank draws the same order from the sampler and
``BatchSamplerShard`` deals the underlying batches out in turn, so after each rank took ``k``
batches the first ``k * world * batch_size`` samples of the order were consumed (``k *
batch_size`` with ``split_batches``): a prefix, which ``consumed`` records. The order is
DistributedSampler's (``order: "distributed"``) for a ``SeedableRandomSampler`` (``seed +
epoch``) or a ``SequentialSampler``; a ``RandomSampler`` drawing from a generator records that
generator's state at the epoch's start (``"generator"``), a sampler of the user's own its class
(``"sampler:<class>"``).

A resume from a position (another world size, another framework's checkpoint, or a save made
in such a resumed pass) computes the epoch's order (DistributedSampler's, or the loader's own
sampler drawn again from the saved generator or epoch) and gives each rank its part of the
rest, dealt out in turn as ``DistributedSampler`` deals (``rank_part``): for that one pass the
batch sharding is a passthrough and the inner batch sampler draws from the rank's part, in
batches of the per-rank size. Every rank has as many samples, so as many batches; the rest is
padded with the order's first samples only where it does not divide by the world size, as
``DistributedSampler`` pads. So every sample of the epoch is seen once whatever the sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardkeeper.core.adapter import DISTRIBUTED_ORDER, POSITION_KEYS, count_problems, epoch_order, rank_part
from shardkeeper.core.errors import StateMismatchError

log = logging.getLogger(__name__)

#: The position layout's version and padding (``ResumableDistributedSampler``'s).
VERSION, PADDING = 1, "head"


def inner_batch_sampler(dl: Any) -> Any:
    """The batch sampler under Accelerate's ``BatchSamplerShard`` (the loader's own when unsharded)."""
    bs: Any = getattr(dl, "batch_sampler", None)
    while hasattr(bs, "batch_sampler"):
        bs = bs.batch_sampler
    return bs


def inner_sampler(dl: Any) -> Any:
    """The sampler under the loader's batch samplers (``BatchSamplerShard`` wraps one)."""
    bs = inner_batch_sampler(dl)
    return getattr(bs, "sampler", None) if bs is not None else getattr(dl, "sampler", None)


def layout(dl: Any) -> tuple[int, int, bool]:
    """(world size the loader is sharded for, this rank's index, ``split_batches``)."""
    bs = getattr(dl, "batch_sampler", None)
    world = int(getattr(bs, "num_processes", 1) or 1)
    return world, int(getattr(bs, "process_index", 0) or 0), bool(getattr(bs, "split_batches", False))


def order_kind(sampler: Any) -> tuple[str, bool, int]:
    """(``order``, ``shuffle``, ``seed``) of the order ``sampler`` draws."""
    if hasattr(sampler, "initial_seed"):  # SeedableRandomSampler: randperm(seed + epoch)
        return DISTRIBUTED_ORDER, True, int(sampler.initial_seed)
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return DISTRIBUTED_ORDER, False, 0
    if type(sampler) is torch.utils.data.RandomSampler:
        return "generator", True, 0
    return f"sampler:{type(sampler).__name__}", True, 0


def position_of(
    dl: Any, batches_seen: int, order_state: torch.Tensor | None, resumed: Resplit | None
) -> dict[str, Any]:
    """The loader's position after this rank took ``batches_seen`` batches of the current pass
    (``resumed``: a pass resumed from a position)."""
    world, _, split = layout(dl)
    n = len(dl.dataset)
    if resumed is not None:
        consumed = resumed.start + resumed.world * resumed.batch * batches_seen
        order, shuffle, seed = resumed.order, resumed.shuffle, resumed.seed
    else:
        batch = int(getattr(inner_batch_sampler(dl), "batch_size", 0) or 0)
        consumed = batches_seen * batch * (1 if split else world)
        order, shuffle, seed = order_kind(inner_sampler(dl))
    out: dict[str, Any] = {
        "version": VERSION,
        "epoch": int(getattr(dl, "iteration", 0)),
        "consumed": min(consumed, n),
        "dataset_len": n,
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": False,
        "padding": PADDING,
        "order": order,
        "world": world,
    }
    if order != DISTRIBUTED_ORDER and order_state is not None:
        out["generator"] = order_state
    return out


class _Part(torch.utils.data.Sampler[int]):
    """This rank's part of the rest of a resumed epoch."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


class Resplit:
    """One pass of a loader that resumes a saved position: the rest of the epoch, split."""

    def __init__(self, sd: Mapping[str, Any], *, batch: int, world: int) -> None:
        self.saved = dict(sd)
        self.start, self.epoch = int(sd["consumed"]), int(sd["epoch"])
        self.order, self.shuffle, self.seed = str(sd["order"]), bool(sd["shuffle"]), int(sd["seed"])
        self.batch, self.world = batch, world  # per-rank batch size and world size of this pass
        self.sampler: Any = None  # the loader's own sampler, which this pass sets aside
        self._undo: list[tuple[Any, str, Any]] = []

    def indices(self, dl: Any) -> list[int]:
        """The epoch's order: DistributedSampler's, or the loader's own sampler drawn again."""
        n = int(self.saved["dataset_len"])
        if self.order == DISTRIBUTED_ORDER:
            return epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        sampler = inner_sampler(dl)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        state = self.saved.get("generator")
        lent = state is not None and getattr(sampler, "generator", None) is None
        if lent:
            sampler.generator = torch.Generator()
        if state is not None:
            sampler.generator.set_state(state)
        try:
            return [int(i) for i in sampler]
        finally:
            if lent:  # the order's generator, lent for this draw only
                sampler.generator = None

    def install(self, dl: Any) -> None:
        """For this pass: batch sharding a passthrough, the inner batch sampler over this rank's part."""
        _, rank, _ = layout(dl)
        part = rank_part(self.indices(dl), self.start, world=self.world, rank=rank, drop_last=False)
        shard, inner = getattr(dl, "batch_sampler", None), inner_batch_sampler(dl)
        self.sampler = inner.sampler
        if shard is not inner:
            self._set(shard, num_processes=1, process_index=0, split_batches=False, even_batches=False)
            self._set(shard, batch_size=self.batch)
        self._set(inner, sampler=_Part(part), batch_size=self.batch)

    def uninstall(self) -> None:
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()

    def _set(self, obj: Any, **values: Any) -> None:
        for name, value in values.items():
            self._undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)


def resplit(dl: Any, sd: Mapping[str, Any], *, index: int) -> Resplit | None:
    """The pass that resumes ``sd`` on ``dl`` (None: the epoch is over, the next one starts
    whole). Refused when the loader's data or order cannot be the saved one."""
    world, rank, split = layout(dl)
    n, inner = len(dl.dataset), inner_batch_sampler(dl)
    batch = int(inner.batch_size or 0) if isinstance(inner, torch.utils.data.BatchSampler) else 0
    where = f"the data position of prepared DataLoader {index} (rank {rank})"
    missing = [k for k in POSITION_KEYS if k not in sd]
    bad = [f"it lacks {', '.join(missing)}"] if missing else count_problems(sd, n)
    if bad:
        raise StateMismatchError(
            f"shardkeeper.accelerate: {where}: {'; '.join(bad)} (dataset length {n}); the position was "
            f"damaged or edited. Restore another step, or start the epoch from its beginning with "
            f"enable(accelerator, resume_dataloaders=False)"
        )
    if sd["dataset_len"] != n:
        raise StateMismatchError(
            f"shardkeeper.accelerate: {where} is over {sd['dataset_len']} samples, this DataLoader's "
            f"dataset has {n}: resuming it would see samples twice or never. Prepare the same "
            f"DataLoaders in the same order as the saved run, or start the epoch from its beginning "
            f"with enable(accelerator, resume_dataloaders=False)"
        )
    order = str(sd["order"])
    own = order_kind(inner_sampler(dl))[0]
    if order != DISTRIBUTED_ORDER and order != own:
        raise StateMismatchError(
            f"shardkeeper.accelerate: {where} is in the order of {order!r}, which this DataLoader's "
            f"sampler ({own!r}) cannot draw: resuming it would see samples twice or never. Prepare "
            f"the DataLoader as the saved run did (a seeded order resumes anywhere: use_seedable_sampler), "
            f"or start the epoch from its beginning with enable(accelerator, resume_dataloaders=False)"
        )
    if order == "generator" and "generator" not in sd:
        log.warning(
            "shardkeeper: the DataLoader's epoch %d was saved at world size %d without a generator for "
            "its shuffled order (drawn from the global RNG), so at world size %d its order cannot be "
            "given back: samples of that epoch may be seen twice or never. Prepare it with "
            "DataLoaderConfiguration(use_seedable_sampler=True) to resume exactly",
            int(sd["epoch"]), int(sd["world"]), world,
        )  # fmt: skip
    if order == DISTRIBUTED_ORDER and hasattr(inner_sampler(dl), "initial_seed"):
        inner_sampler(dl).initial_seed = int(sd["seed"])  # the next epochs: the saved run's seed
    dl.iteration = int(sd["epoch"])
    if int(sd["consumed"]) >= n:
        dl.iteration += 1
        return None
    if batch <= 0:
        log.warning(
            "shardkeeper: %s cannot be resumed: the DataLoader batches with a batch_sampler of "
            "its own, not torch's BatchSampler, so epoch %d starts from its beginning",
            where, int(sd["epoch"]),
        )  # fmt: skip
        return None
    return Resplit(sd, batch=batch // world if split else batch, world=world)


__all__ = ["Resplit", "inner_batch_sampler", "inner_sampler", "layout", "order_kind", "position_of", "resplit"]
