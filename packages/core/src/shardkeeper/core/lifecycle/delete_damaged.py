"""Deleting a damaged step, the newest one included: what a run does when the step it would
resume from is damaged.

Retention and ``delete()`` never delete the newest committed step, and a save at or below it
is refused (checkpoints are immutable), so a run whose newest step is damaged could otherwise
save nothing there again without someone deleting that step's objects by hand. Here the step
is verified first (every file, size and digest; ``verify.verify_step``) and deleted only when
it is damaged: a manifest that does not validate, a missing or short file, a digest that
differs, a page or index file that does not validate, a file behind an entry the format never
writes (a file where a directory belongs, a link loop or out of the root: restore counts it as
damage too). A storage error while checking proves
nothing, so it propagates or refuses with nothing deleted, as does an intact step or a
manifest of a newer format. The deletion itself is retention's: the manifest first, then the
files no other committed step, commit in progress or newer manifest references (a committed
step whose pages cannot all be read references files nobody knows: nothing is deleted).

The verification (``judge_damaged``) is shared with the quarantine a restore does of the damaged
steps it fell back past (``lifecycle/quarantine.py``), which moves the manifest aside instead of
deleting the step. Needs no torch: ``shardkeeper delete ROOT STEP --damaged`` runs it from any
machine.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from shardkeeper.core.codec.crypto import EncryptedStorage
from shardkeeper.core.commit.catalog import forget_deleted
from shardkeeper.core.commit.committed import load_manifest, manifest_path, manifest_steps, newest_committed
from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignManifestError,
    IncompatibleFormatError,
)
from shardkeeper.core.lifecycle.retention import delete_unreferenced, referenced_paths
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify.report import VerifyReport
from shardkeeper.core.verify.step import verify_step

#: The verification problems that are damage (``verify_report.Problem.kind``); the others (the
#: storage could not answer, a format or encoding this version does not know, a truncated
#: listing) prove none.
DAMAGE = frozenset(
    {
        "manifest",
        "missing-file",
        "size",
        "range",
        "length",
        "digests",
        "digest",
        "tiling",
        "header",
        "path",  # a file entry outside the root, or a file behind an entry the format never writes
        "dtype",
        "page",  # a page (format.md 3.9) missing, of another digest or that does not parse
        "index",  # an index file (described leaves) that does not validate
        "logical",  # chunks intact by their digests that do not form the tensor the save summed
    }
)


@dataclass
class DamagedDeletion:
    """What ``delete_damaged`` found and did."""

    step: int
    damage: list[str] = field(default_factory=list)  # the problems that made it damaged (the first few)


def judge_damaged(
    storage: Storage,
    step: int,
    *,
    read_storage: Storage | None = None,
    files: Collection[str] | None = None,
    verb: str = "deleted",
) -> DamagedDeletion:
    """What makes ``step`` damaged, verified on its stored bytes, or raise with nothing done.
    ``read_storage``: the view that checks what it reads (an encrypted root's authenticated
    view; default ``storage``). ``files`` (root-relative): verify only those files besides the
    manifest and its pages and index files (the ones a restore found damaged); None: every
    file. Raises ``CheckpointNotFoundError`` when the step has no manifest, ``EncryptionKeyError``
    for a wrong key, a ``StorageError`` when the storage fails, and ``ValueError`` when it
    verifies intact, could not be checked (storage errors, a key the provider does not hold, an
    encrypted step without its key) or has a manifest of a newer format or bound to another
    root. ``verb``: what the messages say was not done."""
    reader = read_storage if read_storage is not None else storage
    if isinstance(reader, EncryptedStorage) and not reader.authenticate:
        reader = reader.authenticated()  # a manifest whose MAC fails is a wrong key or damage, said as such
    where = f"step {step} under {storage.url}"
    nothing = f"nothing was {verb}"
    listed = manifest_steps(storage)
    if step not in listed:
        raise CheckpointNotFoundError(f"{where} has no manifest: there is no committed or damaged step to delete")
    out = DamagedDeletion(step)
    try:  # a storage error here or in the verification propagates: nothing is done
        manifest = load_manifest(reader, step)
    except IncompatibleFormatError as e:
        raise ValueError(
            f"{where} was written by a newer shardkeeper ({e}); it is not damaged, and this version "
            f"cannot check it: {nothing}"
        ) from e
    except ForeignManifestError as e:  # it authenticates: intact bytes, bound to another root
        raise ValueError(
            f"{where} authenticates but is bound to another root ({e}). Its bytes are intact, so {nothing}: "
            f"for a moved root, check it with --encryption-root / encryption_root= naming the root "
            f"it was written under"
        ) from e
    except CorruptCheckpointError as e:  # the manifest itself does not validate
        raw = storage.inner if isinstance(storage, EncryptedStorage) else storage  # (no MAC check)
        if isinstance(reader, EncryptedStorage) and _saved_before_encryption(raw, step, listed):
            raise ValueError(
                f"{where} was saved without encryption, and no step below it is encrypted: it is this "
                f"root's own from before encryption was turned on (or the root was never encrypted), so a "
                f"key proves no damage and {nothing}. Check it without a key (--key, encryption=)"
            ) from e
        out.damage = [f"manifest: {e}"]
        return out
    if manifest.encryption is not None and not isinstance(reader, EncryptedStorage):
        raise ValueError(
            f"{where} is encrypted, and no key was given, so its data cannot be checked: {nothing}. "
            f"Give the root's key (--key, or the manager's encryption=)"
        )
    only = None if files is None else frozenset(files)  # None, a whole step: its logical digests too
    report = verify_step(reader, step, manifest=manifest, files=only, logical=only is None)
    damage = [p for p in report.problems if p.kind in DAMAGE]
    if damage:
        out.damage = [p.message for p in damage[:5]]
        return out
    raise _no_damage(storage, step, report, files, where, nothing)


def _no_damage(
    storage: Storage, step: int, report: VerifyReport, files: Collection[str] | None, where: str, nothing: str
) -> ValueError:
    """Why ``step``, verified without damage, is not judged damaged: it could not be checked,
    the files named damaged verify intact now, or the whole step does."""
    if report.problems:
        return ValueError(
            f"{where} could not be checked: {'; '.join(p.message for p in report.problems[:3])}. "
            f"That proves no damage; {nothing}. Retry when the storage answers (or with "
            f"the step's encryption key)"
        )
    if files is not None:
        shown = ", ".join(sorted(files)[:3]) + (" ..." if len(files) > 3 else "")
        return ValueError(
            f"{where}: its manifest validates and the files found damaged ({shown or 'none named'}) verify "
            f"intact now (every digest checked): the damage seen did not last, or lies elsewhere; {nothing}. "
            f"`shardkeeper verify {storage.url} {step}` checks every file"
        )
    newest = newest_committed(storage) == step
    warned = "".join(f" A warning, not damage: {w.message}." for w in report.warnings[:1])
    return ValueError(
        f"{where} verifies intact ({report.files_checked} files, {report.chunks_checked} chunks, "
        f"every digest checked): {nothing}.{warned} "
        + (
            "It is the newest committed step, which a resume goes back to: delete it without "
            "damaged=/--damaged once a newer step is committed"
            if newest
            else "Delete it without damaged=/--damaged (retention's rules)"
        )
    )


def delete_damaged(
    storage: Storage, step: int, *, read_storage: Storage | None = None, catalog: str | None = None
) -> DamagedDeletion:
    """Verify ``step`` and delete it if it is damaged. ``read_storage``: the view that checks
    what it reads (an encrypted root's authenticated view; default ``storage``), through which
    the step is verified; ``storage`` deletes. Raises as ``judge_damaged`` (nothing deleted)."""
    out = judge_damaged(storage, step, read_storage=read_storage)
    where = f"step {step} under {storage.url}"
    listed = manifest_steps(storage)
    live: set[str] = set()
    for s in listed:  # what the committed steps that stay reference, each manifest read once
        if s == step:
            continue
        try:
            other = load_manifest(storage, s)
        except IncompatibleFormatError as e:
            raise ValueError(
                f"{where} is damaged, but step {s} was written by a newer shardkeeper ({e}), so the files it "
                f"references are unknown: nothing was deleted"
            ) from e
        except CorruptCheckpointError:
            continue  # not committed: it protects nothing, as in retention
        except CheckpointError as e:  # the storage: what the step references is unknown
            raise ValueError(
                f"{where} is damaged, but committed step {s} cannot be read ({e}), so the files it references "
                f"are unknown: nothing was deleted. Run `shardkeeper verify {storage.url}`"
            ) from e
        try:
            live |= referenced_paths(s, other)
        except CheckpointError as e:  # a page of step s that cannot be read: step s is committed all the same
            raise ValueError(
                f"{where} is damaged, but committed step {s} references files that cannot all be read ({e}), so "
                f"they are unknown and may include this step's: nothing was deleted. Delete step {s} first "
                f"(`shardkeeper delete {storage.url} {s} --damaged` when its page is damaged), or restore its "
                f"page, then delete step {step} again"
            ) from e
    storage.delete(manifest_path(step))  # it stops being committed first; then its files go
    delete_unreferenced(storage, [step], live, set(listed), "delete --damaged")
    forget_deleted(catalog, storage, [step])
    return out


def _saved_before_encryption(storage: Storage, step: int, listed: list[int]) -> bool:
    """Whether ``step``'s manifest, which does not authenticate under the key, is a valid
    plain one with no encrypted step below it: saved before the root was encrypted. A plain
    step above an encrypted one was put there (restore with the key passes over it, saves
    below it are refused): that one is damage, to be deletable."""
    try:
        if load_manifest(storage, step).encryption is not None:
            return False
    except CheckpointError:
        return False  # not even a plain manifest: damage
    for s in sorted((s for s in listed if s < step), reverse=True):
        try:
            if load_manifest(storage, s).encryption is not None:
                return False
        except CheckpointError:
            continue
    return True


__all__ = ["DAMAGE", "DamagedDeletion", "delete_damaged", "judge_damaged"]
