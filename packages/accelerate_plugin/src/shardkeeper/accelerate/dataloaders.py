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
"""

from __future__ import annotations

import logging
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


class LoaderTracker:
    """Counts the batches one prepared DataLoader has yielded in its current epoch."""

    def __init__(self, dl: Any) -> None:
        self.dl = dl
        self.batches_seen = 0
        self.epoch_rng: dict[str, torch.Tensor] = self._rng_now()
        self._resume: dict[str, Any] | None = None
        self._orig_skip = int(getattr(dl, "skip_batches", 0) or 0)
        self._orig_begin = dl.begin
        self._orig_end = dl.end
        # Instance attributes: DataLoaderShard.__iter__ calls these through ``self``.
        object.__setattr__(dl, "begin", self._begin)
        self._orig_update = acci.hook_per_batch(dl, self._update)
        object.__setattr__(dl, "end", self._end)

    def _rng_now(self) -> dict[str, torch.Tensor]:
        out = {"torch": torch.get_rng_state()}
        out.update({name: g.get_state() for name, g in _generators(self.dl).items()})
        return out

    # -- the hooks ---------------------------------------------------------------------------
    def _begin(self) -> None:
        self._orig_begin()
        self.batches_seen = 0
        if self._resume is not None:  # replay the interrupted epoch's start
            rng = self._resume["epoch_rng"]
            torch.set_rng_state(rng["torch"])
            for name, g in _generators(self.dl).items():
                if name in rng:
                    g.set_state(rng[name])
        self.epoch_rng = self._rng_now()

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
        torch.set_rng_state(self._resume["rng_at_save"])
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
    """All prepared DataLoaders of one accelerator, as one stateful object (``data/<rank>/<i>``)."""

    def __init__(self, dataloaders: list[Any], *, resume: bool) -> None:
        self.dataloaders = dataloaders
        self.resume = resume

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, dl in enumerate(self.dataloaders):
            t = track(dl)
            out[str(i)] = t.state_dict() if t is not None else {"epoch": int(getattr(dl, "iteration", 0))}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for i, dl in enumerate(self.dataloaders):
            t = track(dl)
            if t is not None:
                t.load_state_dict(sd[str(i)], resume=self.resume)
            elif hasattr(dl, "iteration"):
                dl.iteration = int(sd[str(i)]["epoch"])


__all__ = ["LoaderPositions", "LoaderTracker", "track", "untrack"]
