"""Restore with fallback, on every rank (``commit/protocol.py``'s restore order).

The candidates are the asked step, or every step whose directory lists a manifest, newest
first, as rank 0 lists them. Each attempt loads and validates the candidate's manifest and
reads into the target (``restore/flat.py``); the ranks then agree on the worst
``Verdict``: restored, damaged (every rank falls back to the next candidate together, with
a warning; an asked step raises), or fatal (raised: a failing storage may hold an intact
step, and falling back would lose its progress). The damaged steps a fallback passed over
are then quarantined, so that the run can save them again (``restore/quarantine.py``).
What the attempts wrote into the target is tracked (``TargetWrites``): a fallback rewrites
all of it, and an error raised after a write says that the target is partly restored.
"""

from __future__ import annotations

import fnmatch
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from shardkeeper.core import metrics
from shardkeeper.core.codec.crypto import files_look_encrypted
from shardkeeper.core.codec.keys import EncryptionKeyError
from shardkeeper.core.commit import committed as commit
from shardkeeper.core.commit.protocol import Verdict
from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CheckpointRestoreError,
    CorruptCheckpointError,
    StorageError,
    extended,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.progress import merge_back, read_progress, split_targets
from shardkeeper.core.lifecycle.quarantine import named_files
from shardkeeper.core.restore.flat import TargetWrites, restore_flat
from shardkeeper.core.restore.logical_check import judge, warn_marked
from shardkeeper.core.restore.plan import RestoreStats
from shardkeeper.core.restore.quarantine import WHOLE_STEP, quarantine_passed_over
from shardkeeper.core.restore.request import RestoreRequest
from shardkeeper.core.restore.share import PeerExchangeError, ReadShare, peer_group
from shardkeeper.core.runtime.context import ManagerContext
from shardkeeper.core.state.flatten import flatten_for_restore
from shardkeeper.core.state.quantize import check_restore_target

log = logging.getLogger(__name__)


def _selects_progress(pattern: str) -> bool:
    return fnmatch.fnmatchcase("progress/step", pattern) or pattern.rstrip("/*") == "progress"


class Restorer:
    """Restore of one manager. ``last_stats``: what the last attempt that succeeded on this
    rank read (``CheckpointManager.last_restore_stats``); ``last_manifest``: the manifest of the
    step it restored (read once per attempt, kept for the caller); ``quarantined``: the damaged
    steps its last restore quarantined."""

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx
        self.last_stats: RestoreStats | None = None
        self.last_manifest: Manifest | None = None
        self.quarantined: list[int] = []  # the damaged steps the last restore quarantined
        self._loaded: Manifest | None = None

    def restore_state(self, state: Mapping[str, Any], request: RestoreRequest, *, stacklevel: int = 2) -> int:
        """``CheckpointManager.restore``: ``restore`` of ``state`` without its progress
        targets, which are handed the restored step's progress when the request's patterns
        select it (``stacklevel``: of the fallback warning, counted from the caller of this
        method as ``warnings.warn`` counts: 2, its caller's caller)."""
        rest, targets = split_targets(state)
        restored = self.restore(rest, request, stacklevel=stacklevel + 1, allow_empty=bool(targets))
        merge_back(state, rest)
        patterns = request.patterns
        if targets and (not patterns or any(_selects_progress(p) for p in patterns)):
            manifest = self.last_manifest  # the restored step's, read by the restore
            assert manifest is not None and manifest.step == restored
            progress = read_progress(manifest)
            for target in targets.values():
                target.load_progress(progress)
        return restored

    def _candidates(self, request: RestoreRequest) -> list[int]:
        """The steps to try, newest first, the same on every rank (``CheckpointNotFoundError``
        when there are none). By listing alone: each candidate's manifest is validated when it
        is loaded, and a damaged one falls back to the next (never a parse of every manifest)."""
        ctx, step = self.ctx, request.step
        agreed = request.agreed and step is not None  # (two collectives fewer: the tiers agreed on it)
        if ctx.world_size > 1 and not agreed:
            self._same_step_everywhere(step)
        candidates = [step] if step is not None else sorted(commit.manifest_steps(ctx.storage), reverse=True)
        if ctx.world_size > 1 and not agreed:
            candidates = self._agree_candidates(candidates)
        if not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {ctx.storage.url}; nothing to restore (rank "
                f"{ctx.rank}). Check the root, or start training from scratch"
            )
        return candidates

    def restore(
        self, state: Mapping[str, Any], request: RestoreRequest, *, stacklevel: int = 1, allow_empty: bool = False
    ) -> int:
        """The step restored into ``state``, or raise (``stacklevel``: of the fallback warning,
        counted from the caller of this method). A ``state`` without leaves is a ``ValueError``
        (it would restore nothing, silently) unless ``allow_empty`` (the manager's restore of
        progress targets alone, which read the manifest)."""
        ctx = self.ctx
        url = ctx.storage.url
        explicit = request.step is not None
        candidates = self._candidates(request)
        self.quarantined = []
        last_error: BaseException | None = None
        damaged: dict[int, list[str]] = {}  # the steps to quarantine -> the files this rank found damaged
        passed: list[int] = []  # every step passed over
        writes = TargetWrites()  # what the attempts wrote into ``state``: a fallback rewrites it all
        share = self._share_group()
        for s in candidates:
            attempt_share = None if share is None else ReadShare(share, ctx.rank, ctx.world_size, s)
            verdict, err = self._attempt(state, s, request, writes, allow_empty, attempt_share)
            if isinstance(err, PeerExchangeError):  # a rank is gone: every survivor meets this, agree on nothing
                raise partly_restored(err, writes)
            if ctx.world_size > 1:
                verdict = Verdict(ctx.coord.agree_int(verdict, "max"))
            if verdict is Verdict.RESTORED and ctx.settings.logical_check != "off":
                err = judge(ctx, self.last_stats.logical if self.last_stats is not None else None, s)
                if err is not None:  # (the same on every rank)
                    verdict = Verdict.DAMAGED
            if verdict is Verdict.RESTORED:
                self.last_manifest = self._loaded
                assert self._loaded is not None
                mark = warn_marked(ctx, self._loaded, f"restore of step {s} under {url}")
                if self.last_stats is not None:
                    self.last_stats.replicas_disagree = mark
                if last_error is not None:
                    log.warning(
                        "rank %d restored step %d under %s instead of the newer, damaged step(s) %s "
                        "(last error: %s); run `shardkeeper verify %s --logical` to see the damage",
                        ctx.rank,
                        s,
                        url,
                        ", ".join(map(str, passed)),
                        last_error,
                        url,
                    )
                    self.quarantined = quarantine_passed_over(ctx, damaged, stacklevel=stacklevel + 1)
                return s
            if err is None:
                err = CheckpointRestoreError(
                    f"restore of step {s} failed on another rank (rank {ctx.rank} succeeded); see that rank's error"
                )
                err.on_other_rank = True  # type: ignore[attr-defined]  # (its cause is that rank's)
            if verdict is Verdict.FATAL or explicit:
                raise partly_restored(err, writes)
            last_error = err
            passed.append(s)
            if getattr(err, "logical_mismatch", False):  # (whether the step or the restore is wrong: verify --logical)
                damaged[s] = [WHOLE_STEP]
            else:
                damaged[s] = [] if getattr(err, "on_other_rank", False) else named_files(err)
            warnings.warn(
                f"step {s} under {url} is damaged ({err}); falling back to the previous committed step",
                stacklevel=stacklevel + 1,
            )
        assert last_error is not None
        raise partly_restored(
            CheckpointRestoreError(
                f"no committed step under {url} could be restored (rank {ctx.rank}); the last error: {last_error}"
            ),
            writes,
        ) from last_error

    def _same_step_everywhere(self, step: int | None) -> None:
        """Collective: refuse, on every rank, a restore whose ranks asked for different steps
        (or some for a step and some for the newest): rank 0's choice would otherwise be
        restored everywhere, silently."""
        coord, asked = self.ctx.coord, -1 if step is None else step
        lo, hi = coord.agree_int(asked, "min"), coord.agree_int(asked, "max")
        if lo != hi:
            what = "the newest step" if step is None else f"step={step}"
            raise ValueError(
                f"restore under {self.ctx.storage.url}: rank {self.ctx.rank} asked for {what}, but the ranks did not "
                f"all ask for the same step (from {'the newest' if lo < 0 else lo} to {hi}); nothing was read. Pass "
                f"the same step= on every rank (or step=None everywhere for the newest committed step)"
            )

    def _share_group(self) -> Any:
        """The dedicated group of replica-deduplicated reads, or None: alone, or turned off on
        some rank (agreed, so that no rank waits in an exchange the others skip)."""
        ctx = self.ctx
        if ctx.world_size == 1 or not ctx.coord.agree_int(int(ctx.settings.share_restore_reads), "min"):
            return None
        return peer_group(ctx.coord, ctx.settings.commit_timeout_s)

    def _agree_candidates(self, candidates: list[int]) -> list[int]:
        """Every rank uses rank 0's list of steps (its listing may be fresher)."""
        coord = self.ctx.coord
        n = coord.agree_int(len(candidates), "bcast")
        return [coord.agree_int(candidates[i] if i < len(candidates) else -1, "bcast") for i in range(n)]

    def _attempt(
        self,
        state: Mapping[str, Any],
        step: int,
        request: RestoreRequest,
        writes: TargetWrites,
        allow_empty: bool,
        share: ReadShare | None,
    ) -> tuple[Verdict, BaseException | None]:
        """This rank's attempt at ``step`` (the request's other arguments), and its error
        (``share``: its part in the exchange of shared reads, which it joins even when it
        fails first)."""
        ctx = self.ctx
        url = ctx.storage.url
        t0 = time.perf_counter()
        try:
            manifest = self._loaded = readable_manifest(ctx, step)
            check_restore_target(manifest.metadata, state, f"step {step} under {url}")
            flat = flatten_for_restore(state, ctx.rank, strict=request.strict)
            if not flat.leaves and not allow_empty:
                raise ValueError(
                    f"restore(): the target state holds nothing to fill (an empty mapping, or only "
                    f"empty ones), so nothing of step {step} under {url} would be restored (rank "
                    f"{ctx.rank}); pass the state to fill in place, e.g. mgr.restore({{'model': model, "
                    f"'optim': optimizer}}), or read the checkpoint into a new dict with mgr.load()"
                )
            st = self.last_stats = restore_flat(
                ctx.storage,
                step_dir(step),
                manifest,
                flat,
                rank=ctx.rank,
                world_size=ctx.world_size,
                only=request.patterns,
                strict=request.strict,
                optional=request.optional,
                per_rank=request.per_rank,
                per_rank_call=request.per_rank_call,
                cast=request.cast,
                executor=ctx.io,
                max_read_bytes=ctx.settings.max_read_bytes,
                writes=writes,
                share=share,
                logical=ctx.settings.logical_check != "off",
            )
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:  # damaged, or gone since listed
            return Verdict.DAMAGED, e
        except StorageError as e:
            # The storage failed (its retries are spent); the step may be intact. Falling back
            # would resume from older state and lose the newer step's progress: fail loudly.
            err = StorageError(
                f"restore of step {step} under {url} (rank {ctx.rank}) failed because "
                f"the storage did: {e}; the checkpoint may be intact: retry the restore, or pass "
                f"step= to restore an earlier step"
            )
            err.__cause__ = e
            return Verdict.FATAL, err
        except Exception as e:
            return Verdict.FATAL, e
        finally:
            if share is not None:
                share.finish()
        metrics.record(metrics.RESTORE_SECONDS, time.perf_counter() - t0, rank=ctx.rank, step=step)
        metrics.record(metrics.BYTES_READ, st.bytes_read, rank=ctx.rank, step=step)
        log.info(
            "rank %d restored step %d: %d keys, read %d bytes (%d needed) in %.3f s",
            ctx.rank,
            step,
            st.keys,
            st.bytes_read,
            st.bytes_needed,
            time.perf_counter() - t0,
        )
        return Verdict.RESTORED, None


def readable_manifest(ctx: ManagerContext, step: int) -> Manifest:
    """``step``'s validated manifest (authenticated when encrypted); an encrypted step without
    its key is an ``EncryptionKeyError`` naming the remedy, before any data is read."""
    url = ctx.storage.url
    manifest = commit.load_manifest(ctx.read_storage, step)
    if ctx.encryption is None and manifest.encryption is not None:
        if not files_look_encrypted(ctx.storage, step, manifest):
            raise CorruptCheckpointError(
                f"step {step} under {url}: its manifest says it is encrypted, but its data "
                f"files are not: the manifest was edited or damaged; restore another step"
            )
        raise EncryptionKeyError(
            f"step {step} under {url} is encrypted (key {manifest.encryption.get('key_id')}); "
            f"pass its key: CheckpointManager(..., encryption='env:VAR' | 'file:PATH' | a KeyProvider)"
        )
    return manifest


def partly_restored(err: BaseException, writes: TargetWrites) -> BaseException:
    """``err``, its message extended by a warning when failed restore attempts wrote into the
    target (its type and attributes kept: callers catch e.g. ``ChecksumMismatchError``)."""
    if not writes.keys:
        return err
    keys = sorted(writes.keys)
    shown = ", ".join(repr(k) for k in keys[:4]) + (" ..." if len(keys) > 4 else "")
    note = (
        f"The target state is partly restored: reads of step(s) {', '.join(map(str, writes.steps))} "
        f"wrote {len(keys)} of its keys ({shown}) before the restore failed; do not train from it; "
        f"restore again or rebuild it"
    )
    out = extended(err, note)
    if out is err and err.args and isinstance(err.args[0], str) and err.args[0].endswith(note):
        err.partly_restored_note = f". {note}"  # type: ignore[attr-defined]  # (a caller that restores on drops it)
    return out


__all__ = ["Restorer", "partly_restored", "readable_manifest"]
