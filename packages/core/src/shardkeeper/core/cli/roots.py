"""The usual mistakes about ROOT, caught before a command runs, each with its remedy (the
diagnosis itself is the core's, :mod:`shardkeeper.core.runtime.root_check`, shared with the manager).

- A step directory (``ROOT/step-000000001200``) or a path inside one given for the root:
  every command would find "no checkpoint" there; the message names the root.
- A local root that does not exist: ``no such root``, with the nearest existing names as a
  "did you mean" (an object-store prefix cannot be told apart from an empty one, so only
  local paths are checked for existence).
- A local file given for the root (a pointer file: the root and step it names; a file of a
  root, such as ``LATEST``: that root).
"""

from __future__ import annotations

import os

from shardkeeper.core.errors import CheckpointNotFoundError, UsageError
from shardkeeper.core.runtime.root_check import did_you_mean, file_target, in_step_dir, local_path


def check_root(root: str, command: str, *, must_exist: bool = True) -> None:
    """Raise ``UsageError`` (a step directory for a root, a file) or ``CheckpointNotFoundError``
    (a local root that is not there, when ``must_exist``) naming ``root`` and the remedy."""
    inside = in_step_dir(root)
    if inside is not None:
        what, parent, _ = inside
        raise UsageError(
            f"{root} is {what}; the root is {parent} (the folder that holds the step-* "
            f"directories): `shardkeeper {command} {parent}`"
        )
    path = local_path(root)
    if path is None:
        return
    if os.path.isfile(path):
        what, real, _ = file_target(path)
        if real is not None:
            raise UsageError(f"{root} is {what}: `shardkeeper {command} {real}`")
        raise UsageError(f"{root} is a file; a checkpoint root is the folder that holds the step-* directories")
    if must_exist and not os.path.exists(path):
        raise CheckpointNotFoundError(f"no such root: {root}{did_you_mean(path)}")


__all__ = ["check_root"]
