"""Verify a whole root: every committed step (``verify.py``), and every step directory whose
manifest exists but does not validate, so that damage hidden from ``steps()`` is reported too.
"""

from __future__ import annotations

from shardkeeper.core.commit import committed_steps, load_manifest, manifest_path, step_dirs
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.verify import DEFAULT_READ_BYTES, stored_bytes, verify_step
from shardkeeper.core.verify_report import Problem, RootVerifyReport


def verify_root(
    storage: Storage, *, read_bytes: int = DEFAULT_READ_BYTES, progress: bool | None = False
) -> RootVerifyReport:
    """Verify every committed step under the root, and report every step directory whose
    manifest exists but does not validate (or is of a newer format than this version reads).
    ``progress``: a bar on stderr over the stored bytes of every step (None: when stderr is a
    terminal; default off)."""
    report = RootVerifyReport(root=storage.url)
    committed = committed_steps(storage)
    for s, name in sorted(step_dirs(storage).items()):
        if s in committed:
            continue
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in storage.list_dir(name)]
        except CorruptCheckpointError as e:
            report.problems.append(
                Problem(
                    step=s,
                    kind="manifest",
                    file=name,
                    message=f"step {s}: the step directory cannot be listed, so the step is not committed: {e}",
                )
            )
            continue
        if MANIFEST_NAME not in names:
            continue
        try:
            load_manifest(storage, s)
        except CheckpointError as e:
            report.problems.append(
                Problem(
                    step=s,
                    kind="manifest",
                    file=manifest_path(s),
                    message=f"step {s}: the manifest does not validate, so the step is not committed: {e}",
                )
            )
    manifests: list[tuple[int, Manifest]] = []
    for s in committed:
        try:
            m = load_manifest(storage, s)
        except IncompatibleFormatError as e:
            report.problems.append(
                Problem(
                    step=s,
                    kind="unsupported-format",
                    file=manifest_path(s),
                    message=f"step {s}: cannot be verified by this version: {e}",
                )
            )
            continue
        except CheckpointError as e:
            report.problems.append(
                Problem(
                    step=s,
                    kind="manifest",
                    file=manifest_path(s),
                    message=f"step {s}: the manifest could not be read: {e}",
                )
            )
            continue
        manifests.append((s, m))
    bar = None
    if progress is not False:
        from shardkeeper.core.bars import make_bar

        bar = make_bar(
            sum(stored_bytes(m) for _, m in manifests), "verify", progress
        )  # short: a long root would squeeze the bar out
    try:
        for s, m in manifests:
            on_bytes = None if bar is None else bar.update
            report.steps.append(verify_step(storage, s, manifest=m, read_bytes=read_bytes, on_bytes=on_bytes))
    finally:
        if bar is not None:
            bar.close()
    report.problems.sort(key=lambda p: p.step if p.step is not None else -1)
    return report


__all__ = ["verify_root"]
