"""Verify committed checkpoints end to end: files, sizes, byte ranges, digests, headers.

Reads every chunk's stored bytes in bounded windows through the chunk reader
(``codec/read.py``, as restore and export read them; memory use is one read buffer of at
most about 16 MiB at a time, whatever the checkpoint's size) and checks every digest block
the manifest records. Unlike a restore it does not stop at the first problem: each is
reported (``verify/report.py``), naming the step, the key, the file, the byte range, and
what was expected against what was found. The checks themselves are in ``verify/checks.py``;
``logical=True`` also recomputes each leaf's logical digest from the bytes read
(``verify/logical.py``).

Needs no torch: an operator verifies a bucket from any machine (``shardkeeper verify``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.logical_member import MARK, marked_kinds
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.util.sizes import human_size
from shardkeeper.core.verify.checks import StepCheck
from shardkeeper.core.verify.logical import LogicalSums
from shardkeeper.core.verify.report import Collector, Problem, RootVerifyReport, VerifyReport

log = logging.getLogger(__name__)

#: Bytes read per request while checking digests (rounded down to whole digest blocks).
DEFAULT_READ_BYTES = 16 << 20


def verify_step(
    storage: Storage,
    step: int,
    *,
    manifest: Manifest | None = None,
    read_bytes: int = DEFAULT_READ_BYTES,
    on_bytes: Callable[[int], object] | None = None,
    files: Collection[str] | None = None,
    logical: bool = False,
    here_only: bool = False,
) -> VerifyReport:
    """Check one committed step; raises ``CheckpointNotFoundError`` if it is not committed and
    ``CorruptCheckpointError`` if its manifest does not validate (``verify_root`` turns that
    into a problem).

    Checks that every file in ``manifest.files`` exists with its ``size_bytes``; that every
    chunk's byte range lies inside its file and (unencoded) holds exactly its box's bytes;
    that the chunks of every tensor tile its shape; every digest block of every chunk; and,
    for unencoded shard files of this step, that the safetensors header agrees.

    ``on_bytes(n)`` is called as each window of ``n`` stored bytes has been checked (a progress
    bar's ``update``). The result (counts, time, problems) is logged at INFO on this module's
    logger, the problems named.

    ``files`` (root-relative paths): check only those files, their sizes, the chunks they
    hold and their headers, not the tiling (a repair's check of the copies of a step that
    a restore found damaged, before it takes another node's copy; an encrypted root read
    without its key has every file's structure checked, as without ``files``).
    ``report.files_read`` says which files had chunk bytes checked.

    ``logical``: also sum every tensor and bytes leaf from its stored chunks as they are read
    (an encoded chunk decoded: CPU, and one chunk's bytes of memory) and compare its logical
    digest with the recorded one (docs/format.md 6.1): a mismatch is a ``logical`` problem;
    ``report.logical`` counts what was checked and what was not recorded.

    ``here_only`` (a node's directory of a local tier, which holds its own ranks' files and
    the replicas or parity others sent it, not every file of a step): the files present are
    checked as ``files`` would check them, the absent ones are listed in ``report.elsewhere``,
    not as damage; with some absent, ``logical`` is a warning (whole leaves cannot be summed).
    """
    if isinstance(files, str):
        raise TypeError(f"verify_step(files=...) takes a collection of paths, not the string {files!r}")
    if logical and files is not None:
        raise ValueError("verify_step(logical=True) checks whole leaves: it takes no files=")
    t0 = time.monotonic()
    m = manifest if manifest is not None else load_manifest(storage, step)
    only = None if files is None else frozenset(files)
    elsewhere: list[str] = []
    if here_only and files is None:
        only, elsewhere = _present(storage, m)
        if not elsewhere:
            only = None  # (every file here: the whole step is checked, its tiling too)
    report = _verify(
        storage, step, m, read_bytes, on_bytes, only, LogicalSums(m) if logical and not elsewhere else None
    )
    report.elsewhere = elsewhere
    if logical and elsewhere:
        report.warnings.append(
            Problem(
                step=step,
                kind="elsewhere",
                message=f"step {step}: logical digests not checked: {len(elsewhere)} of its files are not in this "
                f"node's directory (whole tensors cannot be summed here); `shardkeeper verify ROOT {step} --logical` "
                f"on the persistent root checks them",
            )
        )
    report.seconds = time.monotonic() - t0
    _log(report, files is None)
    return report


def _log(report: VerifyReport, whole: bool) -> None:
    """The result at INFO on this module's logger, the problems named (``whole``: every file asked)."""
    step = report.step
    if report.ok:
        log.info(
            "step %d: OK: %d %sfiles, %d chunks, %s checked in %.2f s%s",
            step,
            report.files_checked,
            "" if whole else "of the asked ",
            report.chunks_checked,
            human_size(report.bytes_checked),
            report.seconds,
            "".join(f"; warning: {w.message}" for w in report.warnings),
        )
    else:
        log.info(
            "step %d: DAMAGED: %d problem(s) in %.2f s (%d files, %d chunks, %s checked): %s",
            step,
            len(report.problems),
            report.seconds,
            report.files_checked,
            report.chunks_checked,
            human_size(report.bytes_checked),
            "; ".join(p.message for p in report.problems[:3]) + ("; ..." if len(report.problems) > 3 else ""),
        )


def _present(storage: Storage, m: Manifest) -> tuple[frozenset[str], list[str]]:
    """The files of ``m`` that ``storage`` holds, and those it does not (root-relative)."""
    here: set[str] = set()
    absent: list[str] = []
    try:
        listed = m.every_file(lambda rel, e: None)  # (a damaged page: the check of files says so)
    except CheckpointError:
        listed = m.files
    for rel in sorted(listed):
        path = resolve_file(m.step, rel)
        if path is None:
            continue  # (not a path inside the root: the check of files says so)
        try:
            storage.size(path)
        except CheckpointNotFoundError:
            absent.append(path)
            continue
        except CheckpointError:
            pass  # (damage, or a storage that did not answer: the check of files says which)
        here.add(path)
    return frozenset(here), absent


def stored_bytes(m: Manifest) -> int:
    """The stored bytes of every chunk of ``m`` (what verifying it reads): a bar's total."""
    described = getattr(m.leaves, "described", None)
    if described is not None:  # from the manifest (and its pages): no index file is read for a bar
        try:
            return sum(m.chunk_file_ends().values())
        except CheckpointError:  # a damaged page: said by the verification itself
            return sum(m.chunk_file_ends(pages=False).values())
    return sum(c.length for leaf in m.leaves.values() if leaf.kind != "object" for c in leaf.chunks)


def _verify(
    storage: Storage,
    step: int,
    m: Manifest,
    read_bytes: int,
    on_bytes: Callable[[int], object] | None,
    only: frozenset[str] | None,
    logical: LogicalSums | None,
) -> VerifyReport:
    """Run the checks of ``verify/checks.py`` in order: files, chunk ranges and digests (and
    logical sums), headers, index files and pages."""
    report = VerifyReport(step=step)
    out = Collector(report, storage.describe(step_dir(step)))
    said = m.logical.get(MARK) if isinstance(m.logical, dict) else None
    if said:  # (save/replicas.py: committed under logical_check="warn"): readable, not damaged
        report.warnings.append(
            Problem(
                step=step,
                kind="replicas",
                message=f"step {step} was committed with logical_check='warn' although copies of replicated "
                f"{marked_kinds(str(said))} disagreed at the save: {str(said)[:2000]}; the written copy is what a "
                f"restore gets",
            )
        )
    if m.encryption is not None and not getattr(storage, "authenticate", False):
        # Encrypted, no key (codec/crypto.py): structure only; digests and tags need the key.
        from shardkeeper.core.codec.crypto_format import keyless_problems

        report.structure_only = True
        report.files_checked, found = keyless_problems(storage, m, step)
        for kind, message, where in found:
            out.add(kind, message, file=where)
        if logical is not None:
            logical.unread(report)
        out.finish()
        return report
    check = StepCheck(storage, step, m, report, out, only, logical=logical)
    check.files()
    reader, block, span = check.digest_reader(read_bytes)
    described = getattr(m.leaves, "described", None)
    if described is not None:  # count the boxes of the rule asked for, to find rows beyond them
        described.track = {}
    check.chunks(reader, block, span, on_bytes)
    if logical is not None:
        logical.judge(out, report, storage.url)
    check.missing_files()
    check.headers()
    check.index_files(described)
    out.finish()
    return report


__all__ = [
    "DEFAULT_READ_BYTES",
    "Problem",
    "RootVerifyReport",
    "VerifyReport",
    "stored_bytes",
    "verify_step",
]
