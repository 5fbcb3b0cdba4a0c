"""Verify a whole root: every committed step (``verify/step.py``), and every step directory whose
manifest exists but does not validate, so that damage hidden from ``steps()`` is reported too.
"""

from __future__ import annotations

from shardkeeper.core.commit.committed import load_manifest, manifest_path, step_dirs
from shardkeeper.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    EncryptionKeyError,
    IncompatibleFormatError,
)
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.bars import make_bar
from shardkeeper.core.verify.report import Problem, RootVerifyReport
from shardkeeper.core.verify.step import DEFAULT_READ_BYTES, stored_bytes, verify_step


def verify_root(
    storage: Storage,
    *,
    read_bytes: int = DEFAULT_READ_BYTES,
    progress: bool | None = False,
    logical: bool = False,
    here_only: bool = False,
) -> RootVerifyReport:
    """Verify every committed step under the root, and report every step directory whose
    manifest exists but does not validate (or is of a newer format than this version reads).
    ``progress``: a bar on stderr over the stored bytes of every step (None: when stderr is a
    terminal; default off). ``logical``: also recompute each leaf's logical digest;
    ``here_only``: a node's directory of a local tier (both: ``verify_step``). One listing of the root and one read of each manifest."""
    report = RootVerifyReport(root=storage.url)
    manifests: list[tuple[int, Manifest]] = []
    for s, name in sorted(step_dirs(storage).items()):
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in storage.list_dir(name)]
        except CorruptCheckpointError as e:
            report.problems.append(
                _problem(s, name, f"the step directory cannot be listed, so the step is not committed: {e}")
            )
            continue
        if MANIFEST_NAME not in names:
            continue  # a save in progress or abandoned: gc's business
        try:
            manifests.append((s, load_manifest(storage, s)))
        except IncompatibleFormatError as e:  # committed, but of a newer format
            report.problems.append(
                _problem(s, manifest_path(s), f"cannot be verified by this version: {e}", "unsupported-format")
            )
        except EncryptionKeyError as e:  # committed, sealed under a key not given: unchecked, not damage
            report.problems.append(
                _problem(
                    s,
                    manifest_path(s),
                    f"not checked: sealed under a key the key given does not hold ({e}). The step is "
                    f"committed; check it with a key provider that holds that key (`shardkeeper keys "
                    f"ROOT` lists the key ids each step needs)",
                    "key",
                )
            )
        except CheckpointError as e:
            report.problems.append(
                _problem(s, manifest_path(s), f"the manifest does not validate, so the step is not committed: {e}")
            )
    # labelled by the command, not the root: a long root would squeeze the bar out
    with make_bar(sum(stored_bytes(m) for _, m in manifests), "verify", progress) as bar:
        for s, m in manifests:
            report.steps.append(
                verify_step(
                    storage,
                    s,
                    manifest=m,
                    read_bytes=read_bytes,
                    on_bytes=bar.update,
                    logical=logical,
                    here_only=here_only,
                )
            )
    return report


def _problem(step: int, file: str, what: str, kind: str = "manifest") -> Problem:
    return Problem(step=step, kind=kind, file=file, message=f"step {step}: {what}")


__all__ = ["verify_root"]
