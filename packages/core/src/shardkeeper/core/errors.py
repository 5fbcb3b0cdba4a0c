"""Every exception class of the core, in one module that imports nothing of the core; warning
categories stay beside what warns. ``tests/core/project/test_errors.py`` fails on an exception
class defined anywhere else.

The errors a caller sees derive from :class:`CheckpointError` and, where one fits, from the
matching builtin, so callers can catch either ``CheckpointError`` or e.g. ``FileNotFoundError``.
Messages name the checkpoint root, the step, the rank, the key or file where known, and one
remedy. The last group are signals between the core's own modules, caught there and turned into
one of the errors above: ``TornStateError`` becomes the cause of a ``CheckpointSaveError``, the
JSON ones an error that names the key or the file, ``UsageError`` the CLI's exit status 2,
``Mismatch`` the ``TypeError`` or ``ValueError`` of an option, ``StoreTimeout`` a
``CheckpointTimeoutError`` naming what was waited for and ``CatalogReadStopped`` a
``CatalogError``. They derive from builtins only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class CheckpointError(Exception):
    """Root of all shardkeeper errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for (empty root, missing step)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes or metadata are damaged: a bad manifest, a short file, a wrong digest.
    ``file``: the damaged file (root-relative) when one is named (empty otherwise)."""

    file: str = ""


class ForeignManifestError(CorruptCheckpointError):
    """An encrypted manifest that authenticates with the key but is bound to another root: the
    root was moved or copied (intact: read it with ``encryption_root=``), or a step of another
    root was put here. A restore passes over it like damage; a deletion of damaged steps
    refuses it, since its bytes are intact."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk's bytes do not match the digest recorded in the manifest."""

    def __init__(self, message: str, *, key: str = "", file: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.file = file


class KeyNotHeldError(ChecksumMismatchError):
    """A data file of a step whose manifest authenticated is sealed under a key the provider
    does not hold (``key_id``): a key rotated out while a step still references a file sealed
    under it, or a file put in place of the step's own. Damage to a restore (it falls back),
    not to ``verify`` (kind ``key``) or ``delete --damaged``: the file may be intact."""

    def __init__(self, message: str, *, key_id: str = "", file: str = "") -> None:
        super().__init__(message, file=file)
        self.key_id = key_id


class IncompatibleFormatError(CheckpointError, ValueError):
    """The manifest is of another ``format_version`` (a pre-release build wrote it) or requires
    a feature this shardkeeper does not know (a newer one wrote it): committed, not readable."""


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


class StartRefusedError(StepOrderError, ValueError):
    """A run that starts at or below the newest committed step of its root (a fresh run on a
    used root, a resume from an older step): it could commit none of its saves up to that
    step, so an adapter refuses it before its first training step, not at its first save.
    ``step`` is the first step the run could save, ``newest`` the root's newest step."""


class StepClaimedError(CommitConflictError):
    """With a local tier: another writer claimed this step on the persistent root (its claim
    file names it) before this save's local commit or upload; two jobs write one root."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A rank did not report in time during a save or restore."""


class TierGroupBroken(CheckpointTimeoutError):
    """An operation of the tiers' group failed or timed out: a rank died or hangs. The group's
    ranks may now be out of step, so every later use raises at once (restart the job)."""


class PeerExchangeError(CheckpointTimeoutError):
    """An operation of the restore exchange failed or timed out: a rank of the group died or
    hangs. Every surviving rank meets it (each round ends in an operation of all ranks), so
    restore raises it at once rather than agree on a verdict over the training group, which
    would wait for the missing rank again."""


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


class SaveTermsMismatch(CheckpointSaveError):
    """The ranks of one save passed different steps, or options that must agree."""


class CoordinatorLostError(CheckpointError):
    """The c10d store, which the coordinator (rank 0) hosts, cannot be reached: the
    coordinator died or its host is gone. ``what``: the operation that failed."""


class RankLostError(CheckpointError, RuntimeError):
    """A collective of the manager's ranks on the training group failed: a rank died or its
    host is gone (gloo's connection closed; torch's error chained)."""


class ProtocolError(CheckpointError, ValueError):
    """A message in the store is not a record of this protocol (another shardkeeper version on
    some rank, or something else writing under the manager's keys)."""


class CheckpointRestoreError(CheckpointError, RuntimeError):
    """A restore failed on one or more ranks."""


class EncryptionKeyError(CheckpointError, PermissionError):
    """The key provider cannot open a checkpoint: wrong key, no key, or an unknown key id.
    No earlier step fixes this (restore does not fall back)."""


class CatalogError(CheckpointError):
    """The catalog could not be read or written (the checkpoints themselves are unaffected)."""


# --------------------------------------------------------------------------------------------
# Caught inside the core


class JsonValueError(ValueError):
    """A value that would not come back exactly: ``path`` (``/``-joined below the leaf) says where."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path or '(the value itself)'}: {why}" if path else why)
        self.path = path
        self.why = why


class TornStateError(RuntimeError):
    """Tensors of an overlapped save were changed in place before their staging copy ended."""

    def __init__(self, keys: list[str]) -> None:
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        super().__init__(
            f"{len(keys)} tensor(s) were modified in place while overlapped staging was still "
            f"copying them ({shown}), outside an optimizer step; the copy would be torn, so this "
            f"save is not committed. Call mgr.wait_staged() before modifying saved tensors "
            f"outside optimizer.step(), or create the manager with staging='blocking'"
        )
        self.keys = keys


class UntrustedJSONError(ValueError):
    """A document from storage was refused; the message says why (without naming the file)."""


class UsageError(Exception):
    """A bad argument to the CLI or nothing to work on: exit 2 with one line on stderr."""


class Mismatch(Exception):
    """A value does not fit a type (config/types.py): ``reason`` says why; ``kind`` is the
    exception to raise (TypeError: the wrong kind of value; ValueError: the right kind, not
    among the choices), with a message that names the option."""

    def __init__(self, reason: str, kind: type[Exception] = TypeError) -> None:
        super().__init__(reason)
        self.kind = kind


class StoreTimeout(Exception):
    """A store channel's ``wait`` timed out (the key was not set in time); each caller raises
    its own ``CheckpointTimeoutError``, naming what it waited for."""


class PersistChannelClosed(EOFError):
    """The other end of a trainer's channel to its persist process is gone: it exited, or
    closed the channel; the trainer turns it into a ``CheckpointSaveError`` naming the step."""


class CatalogReadStopped(Exception):
    """The deadline passed, or the answer grew past its cap, while ``http.client`` read the
    catalog's answer (the message: ``deadline`` or ``cap``); it becomes a ``CatalogError``."""


class PointerDamagedError(ValueError):
    """Bytes that are a pointer's (its zip member, or a bare ``{``) but cannot be read; the
    message says what was found, for the caller to name the file and the remedy."""


class TooManyLost(CheckpointError):
    """More files of an erasure-coded group are lost than its parity can rebuild
    (``tiers/erasure.py``): the restore falls back as without parity."""


def extended(err: BaseException, note: str, *, head: str = "") -> BaseException:
    """``err`` with ``head`` before its message and ``note`` after it, its type and attributes
    kept (callers catch e.g. ``KeyError`` or ``ChecksumMismatchError``): in its message where
    that is its first argument, else as a note (Python >= 3.11), else a
    ``CheckpointRestoreError`` caused by it."""
    if err.args and isinstance(err.args[0], str) and type(err).__str__ is BaseException.__str__:
        err.args = (f"{head}{err.args[0].rstrip('. ')}. {note}", *err.args[1:])
        return err
    if hasattr(err, "add_note"):
        err.add_note(f"{head}{note}")
        return err
    wrapped = CheckpointRestoreError(f"{head}{type(err).__name__}: {err}. {note}")
    wrapped.__cause__ = err
    return wrapped


__all__ = [
    "extended",
    "PointerDamagedError",
    "TooManyLost",
    "CatalogError",
    "CatalogReadStopped",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ChecksumMismatchError",
    "CommitConflictError",
    "CoordinatorLostError",
    "CorruptCheckpointError",
    "EncryptionKeyError",
    "ForeignManifestError",
    "IncompatibleFormatError",
    "KeyNotHeldError",
    "Mismatch",
    "PeerExchangeError",
    "PersistChannelClosed",
    "ProtocolError",
    "JsonValueError",
    "RankLostError",
    "SaveTermsMismatch",
    "StartRefusedError",
    "StateMismatchError",
    "StepClaimedError",
    "StepOrderError",
    "StorageError",
    "StoreTimeout",
    "TierGroupBroken",
    "TornStateError",
    "UntrustedJSONError",
    "UsageError",
]
