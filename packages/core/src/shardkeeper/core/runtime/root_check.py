"""The usual mistakes about a root, told from its path alone, shared by the CLI and the manager.

- A step directory (``ROOT/step-000000001200``) or a path inside one given for the root:
  every reader would find "no checkpoint" there, and a save would nest a step inside a step.
  Told by the name (an object-store URL too, without a request), unless the folder holds step
  directories itself (then it is a root, whatever its name).
- A local file given for the root; a shardkeeper pointer file (an adapter's ``last.ckpt``) is
  told apart and named with the root and step it points at, a file of a root (``LATEST``)
  with that root.
- A local root that does not exist, with the nearest existing names as a "did you mean", and
  whether its parent is missing too (a typo'd path, when the first missing folder's name is
  close to an existing one's, rather than a new run's folder).

The CLI (``cli/roots.py``) turns these into a usage error with the command to run;
``CheckpointManager`` (:func:`check_manager_root`) refuses a step directory or a file and
warns when the root's parent does not exist and looks like a typo. Torch-free.
"""

from __future__ import annotations

import difflib
import os
import warnings

from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format.layout import parse_step_dir
from shardkeeper.core.format.pointer import MAX_POINTER_BYTES, is_pointer_format, looks_like_pointer, pointer_document


def local_path(root: str) -> str | None:
    """The local path of ``root`` (``file://`` stripped); None for another URL."""
    if root.startswith("file://"):
        return root[len("file://") :]
    return None if "://" in root else root


def in_step_dir(root: str) -> tuple[str, str, int] | None:
    """``(what, the root, step)`` when ``root`` is a step directory or a path inside one
    (``what``: ``"a step directory"`` or ``"inside the step directory step-..."``), else None."""
    path = local_path(root)
    parts = root.rstrip("/").split("/")
    for i, part in enumerate(parts):
        step = parse_step_dir(part)
        if i and step is not None and not (path is not None and holds_steps(path)):
            parent = "/".join(parts[:i]) or "/"
            what = "a step directory" if i == len(parts) - 1 else f"inside the step directory {part}"
            return what, parent, step
    return None


def holds_steps(path: str) -> bool:
    """Whether the local folder ``path`` holds step directories itself (then it is a root,
    whatever its own name)."""
    try:
        return any(parse_step_dir(n) is not None for n in os.listdir(path))
    except OSError:
        return False


def pointer_target(path: str) -> tuple[str, int] | None:
    """``(root, step)`` a shardkeeper pointer file names (an adapter's ``last.ckpt``:
    :mod:`shardkeeper.core.format.pointer`, whose ``format`` is ``shardkeeper-<adapter>-pointer``);
    None for any other file. A local root that moved with its pointer is looked for by
    ``root_relative``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POINTER_BYTES + 1)
        doc = pointer_document(data) if looks_like_pointer(data) else None
    except (OSError, ValueError):
        return None
    if doc is None:
        return None
    fmt, root, step, rel = doc.get("format"), doc.get("root"), doc.get("step"), doc.get("root_relative")
    if not is_pointer_format(fmt):
        return None
    if not isinstance(root, str) or type(step) is not int:
        return None
    named = local_path(root)
    if named is not None and not os.path.isdir(named) and isinstance(rel, str):
        moved = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), rel))
        root = moved if os.path.isdir(moved) else root
    return root, step


def file_target(path: str) -> tuple[str, str | None, int | None]:
    """What the local file ``path``, given for a root, is: ``(what, the root it belongs to or
    names, the step a pointer names)``; the root is None for a file of no root."""
    target = pointer_target(path)
    if target is not None:
        return f"a shardkeeper pointer file naming step {target[1]} of the root {target[0]}", *target
    folder = os.path.dirname(path.rstrip("/")) or "."
    if holds_steps(folder):
        return f"a file of the root {folder}", folder, None
    return "a file", None, None


def missing_above(path: str) -> str | None:
    """The highest missing folder above the local ``path`` when its parent does not exist
    (a typo'd path), else None."""
    path = os.path.normpath(path)
    parent = os.path.dirname(path) or "."
    if os.path.isdir(parent):
        return None
    up = parent
    while not os.path.isdir(os.path.dirname(up) or ".") and os.path.dirname(up) != up:
        up = os.path.dirname(up)
    return up


def did_you_mean(path: str) -> str:
    """``; did you mean X?`` from the names next to ``path``, or where the path stops existing."""
    up = missing_above(path)
    if up is not None:
        return f" ({up} does not exist either)"
    close = close_names(path)
    return f"; did you mean {close}?" if close else ""


def close_names(path: str) -> str:
    """The existing folders next to the local ``path`` whose names are close to its own
    (``"a or b"``), or ``""``."""
    parent, name = os.path.split(os.path.normpath(path))
    parent = parent or "."
    try:
        names = [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return " or ".join(os.path.join(parent, c) if parent != "." else c for c in close)


def check_manager_root(root: str) -> None:
    """``CheckpointManager``'s check of its root, before it is opened: a step directory, a
    path inside one or a file is refused with ``CheckpointError`` naming the real root (a
    pointer's root and step). A local root whose parent does not exist either, where the
    first missing folder's name is close to an existing one's (a typo: ``runz`` beside
    ``runs``), warns: a new root would be created there at the first save, and a restore
    would find nothing, so the run would start afresh silently. A new run's folders with no
    such neighbour (``project_dir/checkpoints`` of a new project) do not warn."""
    inside = in_step_dir(root)
    if inside is not None:
        what, parent, step = inside
        raise CheckpointError(
            f"CheckpointManager(): {root} is {what}; the root is {parent} (the folder that holds the step-* "
            f"directories): CheckpointManager({parent!r}), and restore(state, step={step}) for that step"
        )
    path = local_path(root)
    if path is None:
        return
    if os.path.isfile(path):
        what, real, named = file_target(path)
        if real is None:
            remedy = "; a checkpoint root is the folder that holds the step-* directories"
        else:
            remedy = f": CheckpointManager({real!r})" + (
                f", and restore(state, step={named}) for that step" if named is not None else ""
            )
        raise CheckpointError(f"CheckpointManager(): {root} is {what}{remedy}")
    up = missing_above(path)
    close = close_names(up) if up is not None else ""
    if close:
        warnings.warn(
            f"CheckpointManager(): the root {root} does not exist, nor does {up}: did you mean {close}? A new "
            f"root is created there at the first save, and a restore finds nothing (the run starts afresh)",
            stacklevel=4,  # the caller of CheckpointManager()
        )


__all__ = [
    "check_manager_root",
    "close_names",
    "did_you_mean",
    "file_target",
    "holds_steps",
    "in_step_dir",
    "local_path",
    "missing_above",
    "pointer_target",
]
