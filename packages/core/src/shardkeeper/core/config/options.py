"""``CheckpointOptions``: a manager's knobs, typed, grouped and validated when made.

The dataclass is flat (``CheckpointManager(root, async_save=..., staging=...)``); ``GROUPS``
sorts its fields for docs and error messages. Every value is checked against the field's
declared type (``typing.get_type_hints``, so ``Literal`` choices are the choices), ranges are
checked, and a combination in which an option would be silently ignored raises or warns
(``IneffectiveOptionWarning``). Reading settings from text (environment, files, framework
config sections) is ``shardkeeper.core.config.settings``, which converts by the same types. Torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

from shardkeeper.core.codec.keys import KeyProvider
from shardkeeper.core.config.schedule import KeepBest, check_keep_best, check_schedule
from shardkeeper.core.config.types import Mismatch, check_value, conform, type_name
from shardkeeper.core.format.layout import MAX_DATA_PREFIXES

if TYPE_CHECKING:
    from shardkeeper.core.storage.retry import RetryPolicy

Staging = Literal["blocking", "overlap"]
Writer = Literal["thread", "process"]
PerRankPolicy = Literal["map", "exact", "modulo", "drop"]
DigestAlgorithm = Literal["xxh3_128", "sha256"]
Compression = Literal["zstd", "none"]
LogicalCheck = Literal["error", "warn", "off"]


class IneffectiveOptionWarning(UserWarning):
    """An option is set to a non-default value that another option's value makes ineffective."""


@dataclass(frozen=True)
class CheckpointOptions:
    """Knobs of a manager; validated when made. Defaults suit a local disk or an object store.

    Fields by group: ``GROUPS``. Wrong types raise ``TypeError``, values out of range or not
    among the choices ``ValueError``, both naming the option, the value and what it takes.
    """

    async_save: bool = True
    """``save()`` returns once the state is staged; writing and commit run in the background."""
    staging: Staging = "blocking"
    """blocking: ``save()`` copies everything before it returns. overlap: the copy of the
    parameters and state of the optimizers in the saved state runs in the background, and
    their next ``optimizer.step()`` waits for it; other in-place changes of those tensors
    need ``mgr.wait_staged()`` first (docs/performance.md, "Overlapped staging"). Only
    background saves stage: with ``async_save=False`` it applies to ``save(async_save=True)``
    calls alone, and making such options warns."""
    writer: Writer = "thread"
    """Where a save is hashed, encoded, written and committed. thread: a background thread of
    the trainer's process. process: a persist process per rank, which maps the staging buffer
    (shared memory: one copy) and commits with the other ranks' persist processes, so that
    the save runs beside training without its interpreter's lock and a save whose ``save()``
    returned commits even if the trainer is killed right after (docs/reliability.md, "The
    persist process"). With ``local=``, the persist processes also replicate, commit, record,
    upload and retain (docs/tiers.md); several ranks need a TCPStore."""
    per_rank: PerRankPolicy = "map"
    """Per-rank state (RNG, data position) at another world size: map (rank r takes saved rank
    r's, a new rank keeps its own; warns) | exact (refuses) | modulo | drop (restore/per_rank.py)."""
    share_restore_reads: bool = True
    """In a group: a byte range several ranks restore is read from storage by one of them and
    sent to the others over a dedicated gloo group, verified by each (docs/performance.md,
    "Replica-deduplicated restore"); False: every rank reads all it restores itself."""
    digest: DigestAlgorithm = "xxh3_128"
    """Chunk digest: xxh3_128 (fast, default) or sha256 (cryptographic)."""
    digest_block_bytes: int = 64 << 10
    """Digest granularity: a ranged read is widened to these blocks to be verified."""
    logical_check: LogicalCheck = "error"
    """Logical digests (docs/format.md 6.1: one per tensor, whatever its sharding): saves
    record them and compare the copies of replicated tensors with the written one, and a
    restore sums what it assembled and compares (docs/reliability.md, "Logical digests").
    error: copies that disagree fail the save; a restored tensor that does not match fails
    the step as damage (restore falls back to an earlier one; ``load()`` raises). warn: a
    warning and the ``checkpoint_logical_mismatches_total`` metric, and the save commits
    (marked) or the restore goes on. off: nothing is summed, recorded or checked."""
    commit_timeout_s: float = 1800.0
    """How long the coordinator waits for every rank's report, and ranks for the outcome."""
    commit_group_ranks: int = 128
    """At a world larger than this, ranks 1, 2, ... form groups of this many consecutive ranks,
    each led by its first rank (rank 0, the coordinator, is a group of its own): a leader folds
    its group's reports into one and writes their records into a page (docs/format.md 3.9), so
    that the coordinator's work and the manifest do not grow with ranks (docs/protocol.md,
    "Group commit"). Every rank must pass the same value."""
    io_threads: int = 4
    """Parallel file writes and ranged reads per rank."""
    max_files_per_rank: int = 4
    """A rank's chunks are spread over up to this many files, written in parallel."""
    min_file_bytes: int = 64 << 20
    """A rank writes a second file only when it has at least twice this much."""
    data_prefixes: int | None = None
    """Spread each save's files over this many hashed subdirectories of ``data/`` (an object
    store serves about 3,500 writes a second per key prefix). None: one per 64 ranks, rounded
    up to a power of two (flat up to 64 ranks, 256 at 16,384), at most 4096."""
    describe_layouts: bool | None = None
    """DTensors sharded by Shard/Replicate placements (and FSDP1's ShardedTensors, ZeRO
    fragments that name their partition) are recorded by their rule (mesh, placements) with
    their chunks in per-rank index files, so that the manifest and restore planning do not grow with ranks x tensors (docs/format.md 3.8). None:
    when such tensors x ranks reach 4096 (and compression is off); True: always (except with
    compression); False: never (every chunk listed in the manifest)."""
    max_read_bytes: int = 64 << 20
    """Upper bound of one ranged read; bounds restore memory to io_threads x this."""
    catalog: str | None = None
    """``etcd://host:2379[/prefix]``: record each commit there too (a hint; the manifest is the truth)."""
    incremental: bool = False
    """Chunks equal to the previous checkpoint's are stored as references to its files."""
    compression: Compression | None = None
    """``"zstd"``: compress each chunk where it pays (the [zstd] extra); None (or "none"): raw."""
    compression_level: int = 3
    """zstd level (1 fast ... 19 small; negative: faster still); only with compression="zstd"."""
    encryption: str | KeyProvider | None = None
    """Client-side AES-256-GCM (the [crypto] extra): ``"env:VAR"``, ``"file:PATH"`` or a
    ``KeyProvider`` (docs/codecs.md, "Encryption"); None: not encrypted."""
    encryption_root: str | None = None
    """What encrypted files and manifests are bound to (a file or step of another root under
    the same key is refused); default: the root's real path or URL. To read a root that was
    moved or copied, pass the root it was written under. Only with ``encryption``."""
    retry_max_attempts: int = 5
    """Attempts per storage call on transient faults (throttling, resets, timeouts); 1: none."""
    retry_base_delay_s: float = 0.2
    """Backoff before retry n: uniform(0, min(retry_max_delay_s, this * 2**(n-1)))."""
    retry_max_delay_s: float = 10.0
    """Cap of one backoff."""
    retry_deadline_s: float = 120.0
    """No retry of one storage call starts later than this after its first attempt."""
    save_every_steps: int | None = None
    """``mgr.should_save(step)`` is True at every step divisible by this (not at or below the
    newest step saved or restored)."""
    save_every_s: float | Literal["advised"] | None = None
    """``mgr.should_save(step)`` is True once this many seconds of rank 0's clock have passed
    since the last True (or the first call); ``"advised"``: the Young/Daly interval from the
    save timings recorded under the root and ``mtbf_s``. Converted to steps by the step time
    measured from the calls; every rank gets rank 0's answer (manager/schedule.py)."""
    mtbf_s: float | None = None
    """The job's mean time between failures (seconds), for ``save_every_s="advised"``."""
    keep_best: KeepBest | None = None
    """``(n, metric, mode)``: retention also keeps the n committed steps with the lowest
    (``"min"``) or highest (``"max"``) ``metadata[metric]`` (lifecycle/best.py)."""

    def __post_init__(self) -> None:
        check_keep_best(self.keep_best)  # its own errors, before the type's
        for name, hint in option_types().items():
            value = check_value(name, getattr(self, name), hint)
            if value is not getattr(self, name):  # an int given for a float field
                object.__setattr__(self, name, value)
            if hint is float:
                _check_number(name, value)
        for name in ("digest_block_bytes", "io_threads", "max_files_per_rank", "min_file_bytes", "max_read_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.digest_block_bytes % 8:
            raise ValueError(f"digest_block_bytes must be a multiple of 8, got {self.digest_block_bytes}")
        if self.data_prefixes is not None and not 1 <= self.data_prefixes <= MAX_DATA_PREFIXES:
            raise ValueError(
                f"data_prefixes must be between 1 and {MAX_DATA_PREFIXES} (or None), got {self.data_prefixes}"
            )
        if self.commit_group_ranks < 2:
            raise ValueError(f"commit_group_ranks must be >= 2, got {self.commit_group_ranks}")
        if self.commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        self.retry_policy()  # validates the retry_* fields
        object.__setattr__(self, "keep_best", check_keep_best(self.keep_best))
        for message in check_schedule(self.save_every_steps, self.save_every_s, self.mtbf_s):
            _ineffective(message)
        _check_references(self)
        _check_combinations(self)

    def retry_policy(self) -> RetryPolicy:
        from shardkeeper.core.storage.retry import RetryPolicy

        return RetryPolicy(
            max_attempts=self.retry_max_attempts,
            base_delay_s=self.retry_base_delay_s,
            max_delay_s=self.retry_max_delay_s,
            deadline_s=self.retry_deadline_s,
        )

    def replace(self, **overrides: Any) -> CheckpointOptions:
        """These options with ``overrides`` (validated again); an unknown name is a
        ``TypeError`` that lists the close matches and the options by group."""
        unknown = [k for k in overrides if k not in OPTION_NAMES]
        if unknown:
            raise TypeError(
                f"unknown CheckpointManager option(s): {describe_unknown(unknown, OPTION_NAMES)}; "
                f"the options, by group: {describe_groups()}"
            )
        return dataclasses.replace(self, **overrides) if overrides else self


#: Float options that infinity makes meaningless: a commit wait past any clock (waits on a
#: store or an event refuse it), a backoff that never ends. ``retry_max_delay_s`` (no cap)
#: and ``retry_deadline_s`` (no deadline) take it.
_FINITE = ("commit_timeout_s", "retry_base_delay_s")


def _check_number(name: str, value: float) -> None:
    """nan is no duration (every comparison with it is false: bounds would silently not hold)."""
    if math.isnan(value):
        raise ValueError(f"{name}=nan; {name} takes a number of seconds, not nan")
    if math.isinf(value) and name in _FINITE:
        raise ValueError(f"{name}={value}; {name} takes a finite number of seconds")


#: The fields of ``CheckpointOptions`` by what they are about (docs/protocol.md, "Options").
GROUPS: dict[str, tuple[str, ...]] = {
    "saving": ("async_save", "staging", "writer", "commit_timeout_s", "commit_group_ranks"),
    "layout": ("max_files_per_rank", "min_file_bytes", "data_prefixes", "describe_layouts"),
    "io": ("io_threads", "max_read_bytes"),
    "restore": ("per_rank", "share_restore_reads"),
    "integrity": ("digest", "digest_block_bytes", "logical_check"),
    "codecs": ("incremental", "compression", "compression_level", "encryption", "encryption_root"),
    "retry": ("retry_max_attempts", "retry_base_delay_s", "retry_max_delay_s", "retry_deadline_s"),
    "catalog": ("catalog",),
    "schedule": ("save_every_steps", "save_every_s", "mtbf_s"),
    "retention": ("keep_best",),
}
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CheckpointOptions))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(CheckpointOptions)}


class OptionDefault:
    """The default of a ``CheckpointManager`` keyword option: "not given", so that an
    ``options=`` object's value stands. Its repr is the ``CheckpointOptions`` default, which is
    what ``help(CheckpointManager)`` and ``inspect.signature`` show."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def value(self) -> Any:
        return _DEFAULTS[self.name]

    def __repr__(self) -> str:
        return repr(self.value)


class _Defaults:
    """``DEFAULT.<option>``: the ``OptionDefault`` of each option (typed ``Any``, so a keyword
    parameter keeps its option's type)."""

    def __getattr__(self, name: str) -> Any:
        if name not in _DEFAULTS:
            raise AttributeError(name)
        return OptionDefault(name)


DEFAULT: Any = _Defaults()


def given_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options among ``values`` (a signature's arguments) that the caller gave."""
    return {k: v for k, v in values.items() if k in _DEFAULTS and not isinstance(v, OptionDefault)}


def group_of(name: str) -> str:
    """The group of option ``name`` (a key of ``GROUPS``)."""
    for group, names in GROUPS.items():
        if name in names:
            return group
    raise KeyError(name)


def describe_groups() -> str:
    """``saving: async_save, staging, ...; layout: ...``: the options for an error message."""
    return "; ".join(f"{g}: {', '.join(names)}" for g, names in GROUPS.items())


def describe_unknown(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``asynch_save (did you mean async_save?), foo``: unknown names with their close matches."""
    known = list(known)
    out = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.6)
        out.append(f"{name} (did you mean {' or '.join(close)}?)" if close else str(name))
    return ", ".join(out)


@functools.cache
def option_types() -> dict[str, Any]:
    """Each option's declared type, resolved from the dataclass (``typing.get_type_hints``)."""
    hints = get_type_hints(CheckpointOptions)
    return {name: hints[name] for name in OPTION_NAMES}


# -- references and combinations -----------------------------------------------------------
def _check_references(o: CheckpointOptions) -> None:
    """The ``catalog`` URL and the ``encryption`` spec are well formed (the key itself, and
    the [crypto] extra, are checked when a manager opens it)."""
    if o.catalog is not None:
        from shardkeeper.core.commit.catalog import open_catalog

        open_catalog(o.catalog)  # a ValueError naming catalog= and an example
    if isinstance(o.encryption, str):
        kind, _, arg = o.encryption.partition(":")
        if kind not in ("env", "file") or not arg:
            raise ValueError(f"encryption={o.encryption!r}; use 'env:VAR', 'file:PATH' or a KeyProvider object")


def _set(o: CheckpointOptions, name: str) -> bool:
    return bool(getattr(o, name) != _DEFAULTS[name])


def _ineffective(message: str) -> None:
    """Warn, attributed to the first caller outside shardkeeper (the code that set the options)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(("shardkeeper.", "dataclasses")):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, IneffectiveOptionWarning, stacklevel=level)


def _check_combinations(o: CheckpointOptions) -> None:
    """Options another option would silently ignore. Raises where the user's intent cannot
    hold (data they asked to bind to a root would be written unencrypted); warns where a
    setting merely has no effect."""
    if o.encryption_root is not None and o.encryption is None:
        raise ValueError(
            f"encryption_root={o.encryption_root!r} without encryption: nothing would be encrypted or "
            f"bound to that root; pass encryption='env:VAR' / 'file:PATH' / a KeyProvider too, or drop "
            f"encryption_root"
        )
    if o.staging == "overlap" and not o.async_save:
        _ineffective(
            "staging='overlap' with async_save=False: a synchronous save writes the tensors themselves "
            "and returns after the commit, so there is no copy to overlap; overlap applies only to "
            "save(..., async_save=True). Set async_save=True, or staging='blocking'"
        )
    if o.compression in (None, "none") and _set(o, "compression_level"):
        _ineffective(
            f"compression_level={o.compression_level} without compression='zstd': chunks are stored raw "
            f"and the level is unused; set compression='zstd' or drop compression_level"
        )
    if o.describe_layouts is True and o.compression not in (None, "none"):
        _ineffective(
            f"describe_layouts=True with compression={o.compression!r}: compression stores large chunks "
            f"as slabs, which no layout rule gives, so every chunk is listed in the manifest; drop one"
        )
    if o.max_files_per_rank == 1 and _set(o, "min_file_bytes"):
        _ineffective(
            f"min_file_bytes={o.min_file_bytes} with max_files_per_rank=1: a rank always writes one file, "
            f"so the threshold for a second one is unused; raise max_files_per_rank or drop min_file_bytes"
        )
    delays = [n for n in ("retry_base_delay_s", "retry_max_delay_s", "retry_deadline_s") if _set(o, n)]
    if o.retry_max_attempts == 1 and delays:
        _ineffective(
            f"{', '.join(f'{n}={getattr(o, n)}' for n in delays)} with retry_max_attempts=1: nothing is "
            f"retried, so the backoff settings are unused; raise retry_max_attempts or drop them"
        )


__all__ = [
    "CheckpointOptions",
    "Compression",
    "DEFAULT",
    "DigestAlgorithm",
    "GROUPS",
    "IneffectiveOptionWarning",
    "KeepBest",
    "Mismatch",
    "OPTION_NAMES",
    "OptionDefault",
    "PerRankPolicy",
    "Staging",
    "Writer",
    "check_value",
    "conform",
    "describe_groups",
    "describe_unknown",
    "given_options",
    "group_of",
    "option_types",
    "type_name",
]
