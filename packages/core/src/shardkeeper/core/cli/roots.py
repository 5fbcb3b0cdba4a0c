"""The usual mistakes about ROOT, caught before a command runs, each with its remedy.

- A step directory (``ROOT/step-000000001200``) or a path inside one given for the root:
  every command would find "no checkpoint" there; the message names the root.
- A local root that does not exist: ``no such root``, with the nearest existing names as a
  "did you mean" (an object-store prefix cannot be told apart from an empty one, so only
  local paths are checked for existence).
- A local file given for the root.
"""

from __future__ import annotations

import difflib
import os

from shardkeeper.core.errors import CheckpointNotFoundError, UsageError
from shardkeeper.core.format.layout import parse_step_dir


def _local_path(root: str) -> str | None:
    if root.startswith("file://"):
        return root[len("file://") :]
    return None if "://" in root else root


def check_root(root: str, command: str, *, must_exist: bool = True) -> None:
    """Raise ``UsageError`` (a step directory for a root, a file) or ``CheckpointNotFoundError``
    (a local root that is not there, when ``must_exist``) naming ``root`` and the remedy."""
    path = _local_path(root)
    parts = root.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if i and parse_step_dir(part) is not None and not (path is not None and _holds_steps(path)):
            parent = "/".join(parts[:i]) or "/"
            what = "a step directory" if i == len(parts) - 1 else f"inside the step directory {part}"
            raise UsageError(
                f"{root} is {what}; the root is {parent} (the folder that holds the step-* "
                f"directories): `shardkeeper {command} {parent}`"
            )
    if path is None:
        return
    if os.path.isfile(path):
        raise UsageError(f"{root} is a file; a checkpoint root is the folder that holds the step-* directories")
    if must_exist and not os.path.exists(path):
        raise CheckpointNotFoundError(f"no such root: {root}{_did_you_mean(path)}")


def _holds_steps(path: str) -> bool:
    """Whether the local folder ``path`` holds step directories itself (then it is a root,
    whatever its own name)."""
    try:
        return any(parse_step_dir(n) is not None for n in os.listdir(path))
    except OSError:
        return False


def _did_you_mean(path: str) -> str:
    """``; did you mean X?`` from the names next to ``path``, or where the path stops existing."""
    path = os.path.normpath(path)
    parent, name = os.path.split(path)
    parent = parent or "."
    if not os.path.isdir(parent):
        up = parent
        while not os.path.isdir(os.path.dirname(up) or ".") and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        return f" ({up} does not exist either)"
    try:
        names = [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if not close:
        return ""
    shown = " or ".join(os.path.join(parent, c) if parent != "." else c for c in close)
    return f"; did you mean {shown}?"


__all__ = ["check_root"]
