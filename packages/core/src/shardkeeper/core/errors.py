"""The exceptions shardkeeper raises.

Every error derives from :class:`CheckpointError` and, where one fits, from the matching
builtin, so callers can catch either ``CheckpointError`` or e.g. ``FileNotFoundError``.
Messages name the checkpoint root, the step, the rank, the key or file where known, and one
remedy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class CheckpointError(Exception):
    """Root of all shardkeeper errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for (empty root, missing step)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes or metadata are damaged: a bad manifest, a short file, a wrong digest."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk's bytes do not match the digest recorded in the manifest."""

    def __init__(self, message: str, *, key: str = "", file: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.file = file


class IncompatibleFormatError(CheckpointError, ValueError):
    """The manifest was written by a newer shardkeeper (a higher ``format_version``)."""


class StateMismatchError(CheckpointError, ValueError):
    """The target state does not match the checkpoint: keys, shapes or dtypes."""


class CommitConflictError(CheckpointError, FileExistsError):
    """Another writer already committed this step (a restarted job racing a zombie)."""


class StepOrderError(CommitConflictError):
    """A save at a step below the newest committed step of its root: a resume from the root
    would go back to that newer step, not to the state saved now."""

    def __init__(self, message: str, *, step: int, newest: int) -> None:
        super().__init__(message)
        self.step = step
        self.newest = newest


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A rank did not report in time during a save or restore."""


class StorageError(CheckpointError, OSError):
    """A storage backend failed; the backend's own exception is kept as ``__cause__``."""


class CheckpointSaveError(CheckpointError, RuntimeError):
    """A save failed on one or more ranks; the checkpoint was not committed.

    ``failures`` maps each failed rank to a short description (phase, path, error).
    """

    def __init__(self, message: str, *, step: int, failures: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.failures: dict[int, Any] = dict(failures or {})


class CheckpointRestoreError(CheckpointError, RuntimeError):
    """A restore failed on one or more ranks."""


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "IncompatibleFormatError",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
]
