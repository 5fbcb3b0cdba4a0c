"""Lightning checkpoint paths as names of shardkeeper steps.

A Lightning path (``.../epoch=0-step=10.ckpt``, ``last.ckpt``) becomes a *pointer file*: a
small JSON document naming the checkpoint root and the step that holds the state. Lightning
keeps working with paths (``ModelCheckpoint`` lists, links and removes them, ``fit(ckpt_path=
"last")`` finds the newest ``last.ckpt``), while the state itself lives once, as a committed
step under the root. Pointers hold no tensors and are never unpickled.

The root also keeps an index of the paths that name each step (``lightning-paths.json``, a
file the format tells readers to ignore), so a step is deleted only when no path names it
any more, across runs.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkeeper.core import parse_step_dir

POINTER_FORMAT = "shardkeeper-lightning-pointer"
INDEX_NAME = "lightning-paths.json"
_MAX_POINTER_BYTES = 1 << 16


@dataclass(frozen=True)
class Target:
    """What a ``ckpt_path`` names: a root, and a step (``None``: the newest committed)."""

    root: str
    step: int | None


def _fs(path: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(path)


def write_pointer(path: str, root: str, step: int) -> None:
    """Write the pointer at ``path`` (atomically on a local disk), creating its directory."""
    data = json.dumps({"format": POINTER_FORMAT, "version": 1, "root": root, "step": step}).encode()
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
        tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    else:
        fs.pipe_file(p, data)


def read_pointer(path: str) -> Target | None:
    """The target of a pointer file, or ``None`` when ``path`` is not a pointer file."""
    fs, p = _fs(path)
    if not fs.isfile(p) or fs.size(p) > _MAX_POINTER_BYTES:
        return None
    try:
        doc = json.loads(fs.cat_file(p))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    return Target(str(doc["root"]), int(doc["step"]))


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
    if pointer is None and _is_root(s):
        return Target(s if "://" in s else os.path.abspath(s), None)
    return pointer


def _is_root(path: str) -> bool:
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


__all__ = ["PathIndex", "Target", "norm_path", "read_pointer", "remove_pointer", "resolve", "write_pointer"]
