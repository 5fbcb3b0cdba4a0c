"""Where each prepared DataLoader stands, and resuming there: skip the batches already seen.

Accelerate's ``DataLoaderShard.__iter__`` calls ``self.begin()`` once per epoch, then
``self._update_state_dict()`` before yielding each batch (once more before the last one),
then ``self.end()``.
Instance attributes shadow those methods (the private per-batch one through
``_internals.hook_per_batch``), so a tracker counts batches without subclassing
(``DataLoaderAdapter`` fakes its ``__class__``, which rules out swapping the class).

Bit-exact mid-epoch resume also needs the random draws made when the epoch started (the
sampler's permutation, the DataLoader iterator's base seed), so the tracker records the
torch RNG and the loader's generators at ``begin()``. On resume the next epoch starts from
those, replays (loads and drops) the batches already seen, and switches to the RNG state of
the checkpoint right where the interrupted run was when it saved.

That per-rank position means nothing at another world size, so each loader's position is also
saved once, as global state (:meth:`LoaderTracker.global_state`): the world size, the epoch,
the batches each rank took, and the state of the sampler's generator at the epoch's start
(the order of the epoch: Accelerate synchronizes it across ranks). Ranks take the underlying
batches in turn (``BatchSamplerShard``), so ``batches_seen * world`` of them were consumed (one
per step with ``split_batches``); a resume at another world size gives the sampler that order
back and skips the consumed batches split across the new ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, cast

import torch

from shardkeeper.accelerate import _internals as acci

log = logging.getLogger(__name__)

_ATTR = "_shardkeeper_tracker"


def _generators(dl: Any) -> dict[str, torch.Generator]:
    """The generators that shape an epoch's order: synchronized one, loader's, sampler's."""
    out: dict[str, torch.Generator] = {}
    cands = {
        "synchronized": getattr(dl, "synchronized_generator", None),
        "loader": getattr(getattr(dl, "base_dataloader", None), "generator", None),
    }
    sampler = _sampler(dl)
    cands["sampler"] = getattr(sampler, "generator", None)
    seen: set[int] = set()
    for name, g in cands.items():
        if isinstance(g, torch.Generator) and id(g) not in seen and g.device.type == "cpu":
            seen.add(id(g))
            out[name] = g
    return out


def _sampler(dl: Any) -> Any:
    try:
        return dl.get_sampler()
    except Exception:
        return None


def _layout(dl: Any) -> tuple[int, bool]:
    """(world size the loader is sharded for, ``split_batches``): (1, False) when unsharded."""
    bs = getattr(dl, "batch_sampler", None)
    return int(getattr(bs, "num_processes", 1) or 1), bool(getattr(bs, "split_batches", False))


def _inner_sampler(dl: Any) -> Any:
    """The sampler under the loader's batch samplers (``BatchSamplerShard`` wraps one)."""
    bs: Any = getattr(dl, "batch_sampler", None)
    while hasattr(bs, "batch_sampler"):
        bs = bs.batch_sampler
    return getattr(bs, "sampler", None) if bs is not None else getattr(dl, "sampler", None)


def _order_generator(dl: Any) -> torch.Generator | None:
    """The generator the sampler draws the epoch's order from (None: none, or seeded per epoch)."""
    sampler = _inner_sampler(dl)
    g = getattr(sampler, "generator", None)
    if hasattr(sampler, "initial_seed") or not isinstance(g, torch.Generator) or g.device.type != "cpu":
        return None
    return g


class LoaderTracker:
    """Counts the batches one prepared DataLoader has yielded in its current epoch."""

    def __init__(self, dl: Any) -> None:
        self.dl = dl
        self.batches_seen = 0
        self.epoch_rng: dict[str, torch.Tensor] = self._rng_now()
        self.epoch_order: torch.Tensor | None = self._order_now()
        self._resume: dict[str, Any] | None = None
        self._orig_skip = int(getattr(dl, "skip_batches", 0) or 0)
        self._orig_begin = dl.begin
        self._orig_end = dl.end
        # Instance attributes: DataLoaderShard.__iter__ calls these through ``self``.
        object.__setattr__(dl, "begin", self._begin)
        self._orig_update = acci.hook_per_batch(dl, self._update)
        object.__setattr__(dl, "end", self._end)

    def _order_now(self) -> torch.Tensor | None:
        g = _order_generator(self.dl)
        return None if g is None else g.get_state()

    def _rng_now(self) -> dict[str, torch.Tensor]:
        out = {"torch": torch.get_rng_state()}
        out.update({name: g.get_state() for name, g in _generators(self.dl).items()})
        return out

    # -- the hooks ---------------------------------------------------------------------------
    def _begin(self) -> None:
        self._orig_begin()
        self.batches_seen = 0
        rng = self._resume["epoch_rng"] if self._resume is not None else None
        if rng is not None:  # replay the interrupted epoch's start
            torch.set_rng_state(rng["torch"])
            for name, g in _generators(self.dl).items():
                if name in rng:
                    g.set_state(rng[name])
        self.epoch_rng = self._rng_now()
        self.epoch_order = self._order_now()

    def _update(self) -> None:
        self._orig_update()
        self.batches_seen += 1
        r = self._resume
        if r is not None and self.batches_seen == r["skip"] + 1:
            self._finish_resume()

    def _end(self) -> None:
        if self._resume is not None:
            self._finish_resume()
        self.batches_seen = 0
        self._orig_end()

    def _finish_resume(self) -> None:
        """The replay reached the point of the save: from here on, the checkpoint's RNG."""
        assert self._resume is not None
        if self._resume["rng_at_save"] is not None:
            torch.set_rng_state(self._resume["rng_at_save"])
        if self._resume.get("lent_generator"):  # the order's generator, lent for this epoch only
            _inner_sampler(self.dl).generator = None
        self.dl.skip_batches = self._orig_skip
        self._resume = None

    def detach(self) -> None:
        """Give the DataLoader its own methods back (a pending resume skip is dropped)."""
        if self._resume is not None:
            self.dl.skip_batches = self._orig_skip
            self._resume = None
        for name in ("begin", "end"):
            vars(self.dl).pop(name, None)
        acci.unhook_per_batch(self.dl)
        vars(self.dl).pop(_ATTR, None)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "epoch": int(getattr(self.dl, "iteration", 0)),
            "batches_seen": self.batches_seen,
            "epoch_rng": dict(self.epoch_rng),
        }
        sampler = _sampler(self.dl)
        if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
            out["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
        return out

    def global_state(self) -> dict[str, Any]:
        """The position as the same on every rank: world size, ``split_batches``, epoch,
        batches each rank took, and the order's generator at the epoch's start (if any)."""
        world, split = _layout(self.dl)
        out: dict[str, Any] = {
            "world": world,
            "split_batches": split,
            "epoch": int(getattr(self.dl, "iteration", 0)),
            "batches_seen": self.batches_seen,
        }
        if self.epoch_order is not None:
            out["order"] = self.epoch_order
        sampler = _inner_sampler(self.dl)
        if hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
            out["seed"], out["sampler_epoch"] = int(sampler.initial_seed), int(sampler.epoch)
        return out

    def load_global_state(self, sd: dict[str, Any], *, resume: bool) -> bool:
        """Resume from the global position when it was saved at another world size (True:
        then the per-rank position is not used). Exact when the underlying batches consumed
        divide by the new world size; otherwise the rest of one round is seen twice (warned)."""
        world, split = _layout(self.dl)
        saved_world = int(sd["world"])
        if saved_world == world:
            return False
        self.dl.iteration = int(sd["epoch"])
        self.batches_seen = 0
        consumed = int(sd["batches_seen"]) * (1 if sd.get("split_batches") else saved_world)
        skip, extra = (consumed, 0) if split else divmod(consumed, world)
        lent = False
        sampler = _inner_sampler(self.dl)
        if "seed" in sd and hasattr(sampler, "initial_seed"):  # SeedableRandomSampler: seed + epoch
            sampler.initial_seed, sampler.epoch = int(sd["seed"]), int(sd["sampler_epoch"])
        if "order" in sd and resume:
            if getattr(sampler, "generator", None) is None:
                sampler.generator, lent = torch.Generator(), True
            sampler.generator.set_state(sd["order"])
        elif "order" not in sd and hasattr(sampler, "generator") and not hasattr(sampler, "initial_seed"):
            log.warning(
                "shardkeeper: the DataLoader's epoch %d was saved at world size %d without a "
                "generator for its shuffled order (drawn from the global RNG), so at world size %d "
                "its order cannot be given back: samples of that epoch may be seen twice or never. "
                "Prepare it with DataLoaderConfiguration(use_seedable_sampler=True) to resume exactly",
                int(sd["epoch"]),
                saved_world,
                world,
            )
        if extra:
            log.warning(
                "shardkeeper: %d batches of epoch %d were consumed at world size %d, which %d ranks "
                "cannot split evenly: each rank skips %d, so %d batches are seen twice. Resume at a "
                "world size that divides %d for every sample once",
                consumed, int(sd["epoch"]), saved_world, world, skip, extra, consumed,
            )  # fmt: skip
        if resume and (skip > 0 or lent):
            self._resume = {"skip": skip, "epoch_rng": None, "rng_at_save": None, "lent_generator": lent}
            self.dl.skip_batches = self._orig_skip + skip
        return True

    def load_state_dict(self, sd: dict[str, Any], *, resume: bool) -> None:
        self.dl.iteration = int(sd["epoch"])
        sampler = _sampler(self.dl)
        if "sampler" in sd and sampler is not None:
            sampler.initial_seed = int(sd["sampler"]["initial_seed"])
            sampler.epoch = int(sd["sampler"]["epoch"])
        self.batches_seen = 0
        self.epoch_rng = {k: v.clone() for k, v in sd["epoch_rng"].items()}
        skip = int(sd["batches_seen"])
        if resume and skip > 0:
            # The RNG state of the checkpoint is set by the time this runs (rng restores first).
            self._resume = {"skip": skip, "epoch_rng": self.epoch_rng, "rng_at_save": torch.get_rng_state()}
            self.dl.skip_batches = self._orig_skip + skip
        else:
            self._resume = None


def track(dl: Any) -> LoaderTracker | None:
    """Attach a tracker to a prepared DataLoader (idempotent); None when it cannot be tracked."""
    existing = getattr(dl, "__dict__", {}).get(_ATTR)
    if existing is not None:
        return cast("LoaderTracker | None", existing)
    kind = type(dl).__name__  # the real class: DataLoaderAdapter fakes __class__
    if kind != "DataLoaderShard":
        log.warning(
            "shardkeeper: %s is not tracked batch by batch (only DataLoaderShard is); its epoch is "
            "saved, a resume restarts the epoch from its first batch",
            kind,
        )
        return None
    t = LoaderTracker(dl)
    object.__setattr__(dl, _ATTR, t)
    return t


def untrack(dl: Any) -> None:
    """Remove :func:`track`'s tracker from ``dl`` (nothing if it has none)."""
    t = getattr(dl, "__dict__", {}).get(_ATTR)
    if t is not None:
        t.detach()


class LoaderPositions:
    """All prepared DataLoaders of one accelerator, as one stateful object (``data/<rank>/<i>``);
    :meth:`global_positions` is their position at any world size (``extra/data_position/<i>``)."""

    def __init__(self, dataloaders: list[Any], *, resume: bool) -> None:
        self.dataloaders = dataloaders
        self.resume = resume
        self.elsewhere: set[int] = set()  # loaders resumed from their global position

    def global_positions(self, present: Collection[str] | None) -> GlobalPositions:
        return GlobalPositions(self, present)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, dl in enumerate(self.dataloaders):
            t = track(dl)
            out[str(i)] = t.state_dict() if t is not None else {"epoch": int(getattr(dl, "iteration", 0))}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for i, dl in enumerate(self.dataloaders):
            t = track(dl)
            if i in self.elsewhere:  # saved at another world size: the global position resumed it
                continue
            if t is not None:
                t.load_state_dict(sd[str(i)], resume=self.resume)
            elif hasattr(dl, "iteration"):
                dl.iteration = int(sd[str(i)]["epoch"])


class GlobalPositions:
    """The trackers' global positions (replicated: rank 0's is saved). On restore, the template
    holds what the checkpoint has (``present``: its keys), so any world size restores it."""

    def __init__(self, positions: LoaderPositions, present: Collection[str] | None) -> None:
        self.positions = positions
        self.present = present

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, dl in enumerate(self.positions.dataloaders):
            t = track(dl)
            if t is None:
                continue
            sd = t.global_state()
            if self.present is not None:  # a restore: the checkpoint's keys, with this shape
                sd.pop("order", None)
                if f"{PREFIX}/{i}/order" in self.present:
                    sd["order"] = torch.Generator().get_state()
            out[str(i)] = sd
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for i, dl in enumerate(self.positions.dataloaders):
            t = track(dl)
            if t is not None and str(i) in sd and t.load_global_state(sd[str(i)], resume=self.positions.resume):
                self.positions.elsewhere.add(i)


#: Where the global positions are in a checkpoint.
PREFIX = "extra/data_position"

__all__ = ["PREFIX", "GlobalPositions", "LoaderPositions", "LoaderTracker", "track", "untrack"]
