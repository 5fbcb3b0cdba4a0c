"""The usual mistakes about ROOT, caught before a command runs, each with its remedy (the
diagnosis itself is the core's, :mod:`shardkeeper.core.runtime.root_check`, shared with the manager),
and the paths that lead to a root, followed.

- A step directory (``ROOT/step-000000001200``) or a path inside one given for the root:
  every command would find "no checkpoint" there; the message names the root.
- A local root that does not exist: ``no such root``, with the nearest existing names as a
  "did you mean" (an object-store prefix cannot be told apart from an empty one, so only
  local paths are checked for existence).
- A pointer file (Lightning's ``last.ckpt``): followed to the root it names, and its step is
  the step of a command whose STEP is optional and not given; said on stderr.
- A local folder that is no root (no step directories, no ``LATEST``) but names one: the
  pointers in it (Lightning's ``ModelCheckpoint`` folder) or a subfolder holding step
  directories (Accelerate's ``project_dir``, whose root is ``project_dir/checkpoints``). One
  such root is followed, said on stderr; several are named, and none is chosen.
- Another local file (a file of a root, such as ``LATEST``: that root is named).

A command that creates its root (``import``) follows nothing: a pointer or a file is an error.
"""

from __future__ import annotations

import os
import sys

from shardkeeper.core.cli.display import say
from shardkeeper.core.errors import CheckpointNotFoundError, UsageError
from shardkeeper.core.format.layout import LATEST_NAME
from shardkeeper.core.runtime.root_check import (
    did_you_mean,
    file_target,
    holds_steps,
    in_step_dir,
    local_path,
    pointer_target,
)


def check_root(root: str, command: str, *, must_exist: bool = True) -> tuple[str, int | None]:
    """``(the root to open, the step a pointer names or None)`` for ``root`` as given. Raise
    ``UsageError`` (a step directory for a root, a file, a folder naming several roots) or
    ``CheckpointNotFoundError`` (a local root that is not there, when ``must_exist``) naming
    ``root`` and the remedy. A path followed to a root is said on stderr."""
    inside = in_step_dir(root)
    if inside is not None:
        what, parent, _ = inside
        raise UsageError(
            f"{root} is {what}; the root is {parent} (the folder that holds the step-* "
            f"directories): `shardkeeper {command} {parent}`"
        )
    path = local_path(root)
    if path is None:
        return root, None
    if os.path.isfile(path):
        what, real, step = file_target(path)
        if real is not None and step is not None and must_exist:
            _exists(real, f" (named by the pointer {root})")
            _say(f"following pointer {root} to root {real} (step {step})")
            return real, step
        if real is not None:
            raise UsageError(f"{root} is {what}: `shardkeeper {command} {real}`")
        raise UsageError(f"{root} is a file; a checkpoint root is the folder that holds the step-* directories")
    if must_exist:
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"no such root: {root}{did_you_mean(path)}")
        found = named_roots(path)
        if len(found) == 1:
            ((real, why),) = found.items()
            _exists(real, f" (named by {why[0]} in {root})")
            _say(f"following {root} to root {real} (it holds no step-* directories; {_listed(why)})")
            return real, None
        if found:
            listed = "; ".join(f"{r} ({_listed(why)})" for r, why in found.items())
            raise UsageError(
                f"{root} is not a checkpoint root (it holds no step-* directories) and leads to "
                f"{len(found)} roots: {listed}. Give one: `shardkeeper {command} {next(iter(found))}`"
            )
    return root, None


def named_roots(folder: str) -> dict[str, list[str]]:
    """The roots the local ``folder`` leads to, when it is no root itself (no step
    directories, no ``LATEST``), each with what leads there: the pointer files directly in it,
    and its subfolders that hold step directories. Empty for a root or a folder leading nowhere."""
    if holds_steps(folder) or os.path.exists(os.path.join(folder, LATEST_NAME)):
        return {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}
    found: dict[str, list[str]] = {}
    seen: dict[str, str] = {}  # real path -> the root as first named

    def add(root: str, why: str) -> None:
        shown = seen.setdefault(os.path.realpath(root), root)
        found.setdefault(shown, []).append(why)

    for name in names:
        sub = os.path.join(folder, name)
        if os.path.isfile(sub):
            target = pointer_target(sub)
            if target is not None:
                add(target[0], f"pointer {name}: step {target[1]}")
        elif os.path.isdir(sub) and holds_steps(sub):
            add(sub, f"its folder {name} holds step-* directories")
    return found


def _listed(why: list[str], most: int = 3) -> str:
    more = f" and {len(why) - most} more" if len(why) > most else ""
    return ", ".join(why[:most]) + more


def _exists(root: str, why: str) -> None:
    """A followed local root must be there (``why``: what named it)."""
    p = local_path(root)
    if p is not None and not os.path.exists(p):
        raise CheckpointNotFoundError(f"no such root: {root}{why}")


def _say(line: str) -> None:
    say(f"shardkeeper: {line}", file=sys.stderr)


__all__ = ["check_root", "named_roots"]
