"""Lightning checkpoint paths as names of shardkeeper steps.

A Lightning path (``.../epoch=0-step=10.ckpt``, ``last.ckpt``) becomes a *pointer file*: a
small file naming the checkpoint root and the step that holds the state (the core's pointer
format, :mod:`shardkeeper.core.format.pointer`: ``torch.load`` of it gives a message naming
both and how to load them). Lightning
keeps working with paths (``ModelCheckpoint`` lists, links and removes them, ``fit(ckpt_path=
"last")`` finds the newest ``last.ckpt``), while the state itself lives once, as a committed
step under the root. Pointers hold no tensors and are never unpickled.

The root also keeps an index of the paths that name each step (``lightning-paths.json``, a
file the format tells readers to ignore), so a step is deleted only when no path names it
any more, across runs.

A pointer names its root twice: ``root`` (absolute, or a URL) and, for a local root,
``root_relative`` (from the pointer's directory). A run directory that was copied or moved
whole keeps resuming: the absolute root is tried first, then the relative one; for pointers
written before ``root_relative`` the root's last path components are looked for beside the
pointer's directory and its parents. A pointer whose root or step is found nowhere raises
:class:`~shardkeeper.core.errors.CheckpointNotFoundError` naming the pointer, the root, the
step and the remedy (:func:`check_pointer`).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from shardkeeper.core import parse_step_dir, step_dir
from shardkeeper.core.adapter import encode_pointer, looks_like_pointer, pointer_message, write_file
from shardkeeper.core.errors import CheckpointNotFoundError
from shardkeeper.lightning.pointer_doc import MAX_POINTER_BYTES, POINTER_FORMAT, POINTER_VERSION, parse_pointer

log = logging.getLogger(__name__)

INDEX_NAME = "lightning-paths.json"


@dataclass(frozen=True)
class Target:
    """What a ``ckpt_path`` names: a root, and a step (``None``: the newest committed).

    ``pointer``: the pointer file it was read from; ``named``: the root that pointer names
    (``root`` is where that root was found, or ``named`` when it was found nowhere)."""

    root: str
    step: int | None
    pointer: str | None = None
    named: str | None = None


def _fs(path: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return cast("tuple[Any, str]", url_to_fs(path))


def write_pointer(path: str, root: str, step: int) -> None:
    """Write the pointer at ``path`` (atomically on a local disk), creating its directory."""
    doc: dict[str, Any] = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "root": root, "step": step}
    if _local(root) and _local(path):
        doc["root_relative"] = os.path.relpath(root, os.path.dirname(os.path.abspath(path))).replace(os.sep, "/")
    data = encode_pointer(
        doc, pointer_message(root, step, _how(path, root)), {"pytorch-lightning_version": _lightning_version()}
    )
    fs, p = _fs(path)
    parent = p.rsplit("/", 1)[0] if "/" in p else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if fs.isdir(p):
        raise IsADirectoryError(
            f"cannot write the shardkeeper pointer for step {step} at {path}: a directory is "
            f"there (a checkpoint of another CheckpointIO?); remove it or choose another path"
        )
    if "://" not in path or path.startswith("file://"):
        # a temporary created anew, renamed over the pointer: never written through a link
        write_file(p, data, tmp=f"{p}.{uuid.uuid4().hex[:8]}.tmp")
    else:
        fs.pipe_file(p, data)


def _lightning_version() -> str:
    """In a pointer's ``torch.load`` view, so that Lightning's own loader (the plugin not
    installed) reaches its ``state_dict``, whose error names the pointer's message."""
    import lightning

    return str(lightning.__version__)


def _how(path: str, root: str) -> str:
    """How to load a pointer's checkpoint, in the message ``torch.load`` of it shows."""
    return (
        f"Resume with Trainer(plugins=[shardkeeper.lightning.ShardkeeperCheckpointIO({root!r})])"
        f".fit(model, ckpt_path={path!r}); load it with shardkeeper.lightning.load_checkpoint({path!r}) "
        f"or, once shardkeeper.lightning is imported, YourModule.load_from_checkpoint({path!r}); "
        f"`shardkeeper ls {path}` lists its root"
    )


def _local(path: str) -> bool:
    """A plain local path (a URL, ``file://`` included, is left to fsspec as it is)."""
    return "://" not in path


def read_pointer(path: str) -> Target | None:
    """The target of a pointer file (its root found as the module docstring says), or ``None``
    when ``path`` is not a pointer file: not a file, or one that does not start as a pointer
    does (a Lightning ``.ckpt`` is a zip whose first member is its ``data.pkl``, or a pickle).
    A file that starts like a pointer but is not a valid one raises (:func:`parse_pointer`):
    it must never reach ``torch.load``."""
    fs, p = _fs(path)
    if not fs.isfile(p):
        return None
    with fs.open(p, "rb") as f:
        data = f.read(MAX_POINTER_BYTES + 1)
    if not looks_like_pointer(data):
        return None
    doc = parse_pointer(path, data)
    named, step, rel = doc["root"], doc["step"], doc.get("root_relative")
    return Target(_locate(path, named, step, rel), step, path, named)


def _locate(pointer: str, named: str, step: int, rel: str | None) -> str:
    """Where the root ``named`` is: itself, else relative to the pointer, else ``named``."""
    if not _local(named) or os.path.isdir(named):
        return named
    here = os.path.dirname(os.path.abspath(pointer))
    if rel is not None:
        moved = os.path.normpath(os.path.join(here, rel))
        return moved if os.path.isdir(moved) else named
    # an older pointer: the root's last components beside the pointer's directory or a parent
    tail = Path(named).parts[1:]
    for up in Path(here, "_").parents[:4]:
        for n in range(1, min(3, len(tail)) + 1):
            guess = up.joinpath(*tail[-n:])
            if (guess / step_dir(step)).is_dir():
                log.warning(
                    "pointer %s names root %s, which is gone; using %s (holds step %d)", pointer, named, guess, step
                )
                return str(guess)
    return named


def check_pointer(target: Target) -> Target:
    """``target`` when it names no pointer, or its root and step exist; else raise."""
    if target.pointer is None or target.step is None or not _local(target.root):
        return target
    where = os.path.join(target.root, step_dir(target.step))
    if os.path.isdir(where):
        return target
    pointer, step = target.pointer, target.step
    if not os.path.isdir(target.root):
        raise CheckpointNotFoundError(
            f"pointer {pointer} names step {step} under root {target.named}, which does not exist "
            f"(nor at the pointer's relative location: a run directory moved without its root?). "
            f"Copy or move the root back to {target.named} (or beside the pointer, as it was), or "
            f"resume from the root where it is now: ckpt_path='<root>/{step_dir(step)}'"
        )
    raise CheckpointNotFoundError(
        f"pointer {pointer} names step {step} under root {target.root}, which has no such step "
        f"(deleted by retention or by hand?). Resume from the root's newest committed step "
        f"(ckpt_path={target.root!r}) or another pointer"
    )


def pointed_step(target: Target, mgr: Any) -> int | None:
    """The step to restore for ``target`` (``mgr``: a manager of its root): its own, unless it
    is a pointer whose step is not committed (a save killed before its commit, under a
    shardkeeper that wrote pointers first; or a damaged manifest): then the newest committed
    step below it, with a warning naming both. Raises :class:`CheckpointNotFoundError` when
    there is none below."""
    step = target.step
    if target.pointer is None or step is None or mgr.is_committed(step):
        return step
    below = [s for s in mgr.steps() if s < step]
    if not below:
        raise CheckpointNotFoundError(
            f"pointer {target.pointer} names step {step} under {target.root}, which is not committed "
            f"(its save did not finish, or its manifest is damaged: `shardkeeper verify {target.root}` "
            f"tells), and no committed step below it is there. Start without ckpt_path, or resume "
            f"from another checkpoint"
        )
    log.warning(
        "pointer %s names step %d under %s, which is not committed (its save did not finish, or its "
        "manifest is damaged): resuming from step %d, the newest committed step below it",
        target.pointer,
        step,
        target.root,
        below[-1],
    )
    return cast("int | None", below[-1])


def remove_pointer(path: str) -> None:
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p)


def _same_root(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def resolve(ckpt_path: Any, root: str) -> Target | None:
    """Map ``ckpt_path`` onto a root and step; ``None`` when it is none of ours.

    Accepted: an int step (or a string of digits) under ``root``; ``root`` itself (the newest
    committed step) or a ``step-XXXXXXXXXXXX`` directory under it; a pointer file; another
    root (a directory with step directories: its newest committed step).
    """
    if isinstance(ckpt_path, int) and not isinstance(ckpt_path, bool):
        return Target(root, ckpt_path)
    s = os.fspath(ckpt_path) if isinstance(ckpt_path, (str, Path)) else str(ckpt_path)
    if s.isdigit() and not os.path.exists(s):
        return Target(root, int(s))
    if _same_root(s, root):
        return Target(root, None)
    base = s.rstrip("/").rsplit("/", 1)
    named = parse_step_dir(base[-1])
    if named is not None and len(base) == 2:
        return Target(base[0], named)
    pointer = read_pointer(s)
    if pointer is None and is_root(s):
        return Target(s if "://" in s else os.path.abspath(s), None)
    return None if pointer is None else check_pointer(pointer)


def is_root(path: str) -> bool:
    """A directory holding step directories (another run's root): its newest step."""
    fs, p = _fs(path)
    if not fs.isdir(p):
        return False
    names = (str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False))
    return any(parse_step_dir(n) is not None for n in names)


class PathIndex:
    """Which Lightning paths name which step, stored under the root (rank 0 only)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.paths: dict[str, int] = {}
        self.orphans: set[int] = set()
        self._load()

    def _load(self) -> None:
        try:
            doc = json.loads(self.storage.read_bytes(INDEX_NAME))
        except Exception:  # absent or unreadable: start empty (it only ever protects more)
            return
        self.paths = {str(k): int(v) for k, v in doc.get("paths", {}).items()}
        self.orphans = {int(s) for s in doc.get("orphans", [])}

    def flush(self) -> None:
        doc = {"paths": self.paths, "orphans": sorted(self.orphans)}
        self.storage.put(INDEX_NAME, json.dumps(doc, indent=1, sort_keys=True).encode())

    def named(self, step: int) -> bool:
        return step in self.paths.values()

    def set(self, path: str, step: int) -> int | None:
        """Point ``path`` at ``step``; returns the step it named before, if any."""
        old = self.paths.get(path)
        self.paths[path] = step
        self.orphans.discard(step)
        if old is not None and old != step and not self.named(old):
            self.orphans.add(old)
        return old

    def drop(self, path: str) -> int | None:
        old = self.paths.pop(path, None)
        if old is not None and not self.named(old):
            self.orphans.add(old)
        return old


def norm_path(path: Any) -> str:
    s = os.fspath(path) if isinstance(path, (str, Path)) else str(path)
    return s if "://" in s else os.path.abspath(s)


__all__ = [
    "PathIndex",
    "Target",
    "check_pointer",
    "is_root",
    "norm_path",
    "parse_pointer",
    "pointed_step",
    "read_pointer",
    "remove_pointer",
    "resolve",
    "write_pointer",
]
