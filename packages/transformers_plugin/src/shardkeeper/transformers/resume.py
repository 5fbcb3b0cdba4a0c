"""What ``train(resume_from_checkpoint=...)`` resumes from, decided before the Trainer starts.

``True`` is the newest committed step under the root; a step number, a root or a step folder
(of any root) work too; a ``checkpoint-N`` folder the Trainer wrote itself goes to the
Trainer's own loaders. Every refusal names the root or folder, the rank and the remedy.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core import CheckpointManager, CheckpointNotFoundError, parse_step_dir

#: The Trainer's own checkpoint folders (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``).
_OWN_FOLDER = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Resume:
    """The committed step a ``train()`` call resumes from."""

    manager: CheckpointManager
    step: int

    @property
    def url(self) -> str:
        return self.manager.step_url(self.step)

    @functools.cached_property
    def keys(self) -> frozenset[str]:
        """The step's keys, read from its manifest once per resume (each loader asks)."""
        return frozenset(self.manager.manifest(self.step).leaves)


def resolve(
    target: Any, manager: Callable[[str | None], CheckpointManager], root: str, rank: int
) -> Resume | str | None:
    """A committed step, a folder of the Trainer's own (its path), or None (a fresh start).
    ``manager(root)``: the manager of a root (None: the run's own, ``root``)."""
    if target is None or target is False:
        return None
    if target is True:
        return newest(manager(None), root, rank)
    if isinstance(target, numbers.Integral) and not isinstance(target, bool):
        step = int(target)
        if step < 0:
            raise ValueError(f"resume_from_checkpoint={step}: a step number is >= 0 (rank {rank})")
        mgr = manager(None)
        if not mgr.is_committed(step):
            raise CheckpointNotFoundError(
                f"shardkeeper.transformers: step {step} is not committed under {root} (rank {rank}); its "
                f"committed steps: {listing(mgr.steps())}. Pass one of them, or True for the newest"
            )
        return Resume(mgr, step)
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(
            f"resume_from_checkpoint must be True, a step number, a root or a step folder, not {target!r} (rank {rank})"
        )
    path = os.fspath(target).rstrip("/")
    if not path:
        raise ValueError(f"resume_from_checkpoint={target!r} names no root or folder (rank {rank})")
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path  # a checkpoint-N folder of the Trainer's own: its own loaders read it
    parent, _, last = path.rpartition("/")
    named = parse_step_dir(last)
    if named is not None and parent:
        mgr = manager(parent)
        if mgr.step_url(named).rstrip("/").endswith("/" + last):
            if not mgr.is_committed(named):
                raise CheckpointNotFoundError(
                    f"shardkeeper.transformers: {path} is not a committed step (rank {rank}): it may be torn "
                    f"by a crash. Committed steps under {parent}: {listing(mgr.steps())}"
                )
            return Resume(mgr, named)
    if os.path.isfile(path):
        raise ValueError(f"resume_from_checkpoint={path!r} is a file, not a root or a step folder (rank {rank})")
    return newest(manager(path), path, rank)


def newest(mgr: CheckpointManager, root: str, rank: int) -> Resume:
    step = mgr.latest_step()
    if step is None:
        own = own_folders(root)
        hint = (
            f"; it holds the Trainer's own folders ({', '.join(own[-3:])}): pass one of them as "
            f"resume_from_checkpoint to resume from it"
            if own
            else ", or start from scratch without resume_from_checkpoint"
        )
        raise ValueError(f"shardkeeper.transformers: no committed checkpoint under {root} (rank {rank}){hint}")
    return Resume(mgr, step)


def own_folders(root: str) -> list[str]:
    """The Trainer's ``checkpoint-N`` folders directly under a local ``root``, by step."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [
        (int(m.group(1)), n) for n in names if (m := _OWN_FOLDER.match(n)) and os.path.isdir(os.path.join(root, n))
    ]
    return [n for _, n in sorted(found)]


def trainer_folder_step(folder: str) -> int:
    """The ``global_step`` in the ``trainer_state.json`` of a folder the Trainer wrote (JSON)."""
    with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
        step = json.load(f).get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"shardkeeper.transformers: {folder}/trainer_state.json has no global_step count")
    return step


def listing(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-8:]))
    return shown if len(steps) <= 8 else f"... {shown}"


__all__ = ["Resume", "listing", "newest", "own_folders", "resolve", "trainer_folder_step"]
