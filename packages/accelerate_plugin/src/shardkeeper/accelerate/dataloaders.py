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
saved once, as global state in the layout every adapter writes (``position.py``): the samples
of the epoch's order consumed, and what the order is. A resume at another world size, from
another framework's checkpoint, or from a save made in such a resumed pass, hands the rest of
the epoch to the ranks from that position (``position.Resplit``); at the world size of an
Accelerate save the per-rank replay above is used.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, cast

import torch

from shardkeeper.accelerate import _internals as acci
from shardkeeper.accelerate.position import Resplit, inner_sampler, layout, position_of, resplit
from shardkeeper.core.adapter import DATA_POSITION_KEY

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


def _order_generator(dl: Any) -> torch.Generator | None:
    """The generator the sampler draws the epoch's order from (None: none, or seeded per epoch)."""
    sampler = inner_sampler(dl)
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
        self.resumed: Resplit | None = None  # this pass resumes a saved position (position.py)
        self._pending: Resplit | None = None  # the next pass will
        self.saved_position: dict[str, Any] | None = None  # the checkpoint's, at a restore
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
        self.resumed, self._pending = self._pending, None
        if self.resumed is not None:
            self.resumed.install(self.dl)

    def _update(self) -> None:
        self._orig_update()
        self.batches_seen += 1
        r = self._resume
        if r is not None and self.batches_seen == r["skip"] + 1:
            self._finish_resume()

    def _end(self) -> None:
        if self._resume is not None:
            self._finish_resume()
        if self.resumed is not None:
            self.resumed.uninstall()
            if self.batches_seen == 0:  # nothing left of the epoch: Accelerate ends no epoch then
                self.dl.iteration = self.resumed.epoch + 1
            self.resumed = None
        self.batches_seen = 0
        self._orig_end()

    def _finish_resume(self) -> None:
        """The replay reached the point of the save: from here on, the checkpoint's RNG."""
        assert self._resume is not None
        if self._resume["rng_at_save"] is not None:
            torch.set_rng_state(self._resume["rng_at_save"])
        self.dl.skip_batches = self._orig_skip
        self._resume = None

    def detach(self) -> None:
        """Give the DataLoader its own methods back (a pending resume skip is dropped)."""
        if self._resume is not None:
            self.dl.skip_batches = self._orig_skip
            self._resume = None
        if self.resumed is not None:
            self.resumed.uninstall()
        self.resumed = self._pending = None
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
            "resumed": self.resumed is not None,  # a pass resumed from a position: so is its resume
        }
        sampler = _sampler(self.dl) if self.resumed is None else self.resumed.sampler
        if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
            out["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
        return out

    def global_state(self) -> dict[str, Any]:
        """The position, the same on every rank, in the layout every adapter writes."""
        order = self.resumed.saved.get("generator") if self.resumed is not None else self.epoch_order
        return position_of(self.dl, self.batches_seen, order, self.resumed)

    def load_position(self, sd: dict[str, Any], *, index: int, resume: bool) -> None:
        """Resume from the position ``sd``: the next pass yields this rank's part of the rest
        of its epoch (the per-rank position is then not used)."""
        self.batches_seen = 0
        self._resume = None
        self.dl.skip_batches = self._orig_skip
        if not resume:  # the epoch only, from its beginning
            self.dl.iteration = int(sd["epoch"])
            return
        self._pending = resplit(self.dl, sd, index=index)

    def load_state_dict(self, sd: dict[str, Any], *, resume: bool, index: int = 0) -> None:
        if sd.get("resumed") and self.saved_position is not None:  # saved in a pass resumed from a position
            self.load_position(self.saved_position, index=index, resume=resume)
            return
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
                t.load_state_dict(sd[str(i)], resume=self.resume, index=i)
            elif hasattr(dl, "iteration"):
                dl.iteration = int(sd[str(i)]["epoch"])


class GlobalPositions:
    """The trackers' global positions (replicated: rank 0's is saved). On restore, the template
    holds the keys the checkpoint has (``present``), so a position any adapter wrote restores."""

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
                head = f"{PREFIX}/{i}/"
                keys = [k[len(head) :] for k in self.present if k.startswith(head)]
                if not keys:
                    continue
                sd = {k: torch.Generator().get_state() if k == "generator" else sd.get(k) for k in keys}
            out[str(i)] = sd
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Each position resumes its loader now where the per-rank one cannot (another world
        size, or none in the checkpoint); else the per-rank restore decides (``load_state_dict``)."""
        for i, dl in enumerate(self.positions.dataloaders):
            t = track(dl)
            if t is None or str(i) not in sd:
                continue
            saved = dict(sd[str(i)])
            t.saved_position = saved
            if int(saved.get("world", 0)) != layout(dl)[0] or not self._per_rank(i):
                t.load_position(saved, index=i, resume=self.positions.resume)
                self.positions.elsewhere.add(i)

    def _per_rank(self, i: int) -> bool:
        """Whether the checkpoint holds a per-rank position of loader ``i`` (``data/<rank>/<i>``)."""
        return self.present is not None and any(
            k.split("/")[2:3] == [str(i)] for k in self.present if k.startswith("data/")
        )


#: Where the global positions are in a checkpoint (every adapter's key).
PREFIX = DATA_POSITION_KEY

__all__ = ["PREFIX", "GlobalPositions", "LoaderPositions", "LoaderTracker", "track", "untrack"]
