"""What ``train(resume_from_checkpoint=...)`` resumes from, decided before the Trainer starts.

``True`` is the newest committed step under the root; a step number, a root, a step folder
(of any root) or a ``checkpoint-N`` folder of shardkeeper's (``folders.py``) work too; a
``checkpoint-N`` folder the Trainer wrote itself goes to the Trainer's own loaders. As text (a
command line's), ``"true"`` and digits mean ``True`` and a step number. Every refusal names the
root or folder, the rank and the remedy.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardkeeper.core import CheckpointManager, CheckpointNotFoundError, CorruptCheckpointError, parse_step_dir
from shardkeeper.transformers.folders import FOLDER, POINTER_NAME, Pointer, read_pointer, same_root

log = logging.getLogger(__name__)


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
    if isinstance(target, str):
        target = _from_text(target)
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
    pointer = read_pointer(path, rank) if os.path.isdir(path) else None
    if pointer is not None:  # a checkpoint-N folder of shardkeeper's
        return _pointed(pointer, manager, root, rank)
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path  # a checkpoint-N folder of the Trainer's own: its own loaders read it
    parent, _, last = path.rpartition("/")
    named = parse_step_dir(last)
    if "://" not in path and not os.path.exists(path) and not (named is not None and os.path.isdir(parent)):
        raise CheckpointNotFoundError(
            f"shardkeeper.transformers: resume_from_checkpoint={path!r}: no such folder (rank {rank}). It takes "
            f"True (the newest committed step under {root}), a step number, a root or a step folder"
        )
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


def _pointed(p: Pointer, manager: Callable[[str | None], CheckpointManager], root: str, rank: int) -> Resume:
    """The committed step a ``checkpoint-N`` folder names."""
    own = same_root(p.root, root)
    if not own and "://" not in p.root and not os.path.isdir(p.root):
        raise CheckpointNotFoundError(
            f"shardkeeper.transformers: {p.folder} names step {p.step} under {p.named}, which does not exist, nor "
            f"beside the folder (rank {rank}): was the root moved apart from its output_dir? Pass the root itself "
            f"as resume_from_checkpoint, or True for the newest committed step under {root}"
        )
    mgr = manager(None if own else p.root)
    if not mgr.is_committed(p.step):
        raise CheckpointNotFoundError(
            f"shardkeeper.transformers: {p.folder} names step {p.step} under {p.root}, which is not committed "
            f"(rank {rank}): the step was deleted (by retention, `shardkeeper delete` or as damaged) after its "
            f"folder was written, and train() removes such a folder from its output_dir. Committed steps under "
            f"{p.root}: {listing(mgr.steps())}. Pass resume_from_checkpoint=True (the newest), or call "
            f"get_last_checkpoint(output_dir) again"
        )
    return Resume(mgr, p.step)


def _from_text(text: str) -> Any:
    """What a command line passes as text (``HfArgumentParser`` gives ``resume_from_checkpoint``
    as a string): ``"true"`` is True and digits are a step number, unless a folder of that
    name exists; anything else is a path."""
    if os.path.exists(text):
        return text
    if text.strip().lower() == "true":
        return True
    return int(text) if text.strip().isdigit() else text


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
    newer = [n for n in own_folders(root) if int(n.removeprefix("checkpoint-")) > step]
    if newer:  # written by the Trainer itself (before shardkeeper was enabled): never picked silently
        log.warning(
            "shardkeeper: resuming from committed step %d under %s, but the Trainer's own folder %s there is newer "
            "(written without shardkeeper: not fenced, not verified); to resume from it, pass "
            "resume_from_checkpoint=%r (rank %d)",
            step,
            root,
            newer[-1],
            os.path.join(root, newer[-1]),
            rank,
        )
    return Resume(mgr, step)


def own_folders(root: str) -> list[str]:
    """The Trainer's own ``checkpoint-N`` folders directly under a local ``root``, by step
    (not shardkeeper's, which hold a pointer)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [
        (int(m.group(1)), n)
        for n in names
        if (m := FOLDER.match(n))
        and os.path.isdir(os.path.join(root, n))
        and not os.path.isfile(os.path.join(root, n, POINTER_NAME))
    ]
    return [n for _, n in sorted(found)]


def trainer_folder_step(folder: str) -> int:
    """The ``global_step`` in the ``trainer_state.json`` of a folder the Trainer wrote (JSON)."""
    with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
        step = json.load(f).get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"shardkeeper.transformers: {folder}/trainer_state.json has no global_step count")
    return step


def with_remedy(e: CorruptCheckpointError, root: str, url: str, step: int, rank: int) -> CorruptCheckpointError:
    """``e`` (same type and attributes) with what a Trainer user does about a damaged step:
    the Trainer resumes only from the newest step, so the damaged one must go first."""
    err = copy.copy(e)
    err.args = (
        f"shardkeeper.transformers: step {step} under {root} is damaged (rank {rank}): {e}. For the Trainer: "
        f"the state is partly restored, so do not train from this process. The Trainer resumes from the "
        f"newest step only: delete the damaged step with `shardkeeper delete {root} {step} --damaged` (it "
        f"verifies the step first and deletes it only if it is damaged; or remove its folder, {url}), then "
        f"train(resume_from_checkpoint=True) resumes from the newest intact step",
    )
    return err


def listing(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-8:]))
    return shown if len(steps) <= 8 else f"... {shown}"


__all__ = [
    "Resume",
    "listing",
    "newest",
    "own_folders",
    "resolve",
    "trainer_folder_step",
    "with_remedy",
]
