"""Names on storage: step directories, shard files, the LATEST hint."""

from __future__ import annotations

import re
import secrets

import xxhash

STEP_PREFIX = "step-"
STEP_DIGITS = 12
LATEST_NAME = "LATEST"
#: The preemption record a ``PreemptionGuard`` leaves at the root (tools/preemption.py).
PREEMPTED_NAME = "preempted.json"
DATA_DIR = "data"
_STEP_RE = re.compile(r"^step-(\d{12,})$")


def step_dir(step: int) -> str:
    """``step-000000001200``: zero-padded so that names sort in numeric order."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a canonical step directory name; None for anything else (also for
    non-canonical spellings like ``step-0000000000042``, so one step has one directory)."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_RE.match(base)
    if not m:
        return None
    step = int(m.group(1))
    return step if base == step_dir(step) else None


def new_attempt_id() -> str:
    """A token unique to one save attempt of one rank, part of every file name it writes."""
    return secrets.token_hex(4)


#: Most hashed subdirectories of ``data/`` a save spreads its files over.
MAX_DATA_PREFIXES = 4096
#: Ranks per hashed subdirectory that ``data_prefixes=None`` aims at.
RANKS_PER_PREFIX = 64


def data_prefixes(option: int | None, world_size: int) -> int:
    """How many hashed subdirectories of ``data/`` a save of ``world_size`` ranks spreads its
    files over: ``option``, or by default one per 64 ranks (rounded up to a power of two, at
    most 4096; 1, a flat ``data/``, up to 64 ranks). An object store serves about 3,500
    writes a second per key prefix; 16,384 ranks writing into one return 503 SlowDown."""
    if option is not None:
        return option
    n = 1
    while n * RANKS_PER_PREFIX < world_size and n < MAX_DATA_PREFIXES:
        n *= 2
    return n


def data_dir(rank: int, prefixes: int = 1) -> str:
    """``data`` or, spread over ``prefixes`` hashed subdirectories, ``data/<hex>``: where rank
    ``rank`` writes (by a hash of the rank, so that the ranks of one node spread too)."""
    if prefixes <= 1:
        return DATA_DIR
    width = len(f"{prefixes - 1:x}")
    return f"{DATA_DIR}/{xxhash.xxh3_64_intdigest(str(rank).encode()) % prefixes:0{width}x}"


def shard_file(rank: int, attempt: str, index: int, prefixes: int = 1) -> str:
    """Relative to the step directory: ``data/r00000-<attempt>-000.safetensors`` (``data/<hex>/...``
    with hashed prefixes, ``data_dir``)."""
    return f"{data_dir(rank, prefixes)}/r{rank:05d}-{attempt}-{index:03d}.safetensors"


_RANK_RE = re.compile(r"^r(\d{5,})-")


def writer_rank(path: str) -> int | None:
    """The rank that wrote a data or index file, from its name (``r00003-<attempt>-000.safetensors``)."""
    m = _RANK_RE.match(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def index_file(rank: int, attempt: str, prefixes: int = 1) -> str:
    """Relative to the step directory: ``data/r00000-<attempt>.index.json``, a rank's chunks
    of described leaves (docs/format.md 3.8), beside its shard files."""
    return f"{data_dir(rank, prefixes)}/r{rank:05d}-{attempt}.index.json"


#: Where a step's pages are (docs/format.md 3.9): beside ``data/``, so that they are not
#: encrypted with the data files; the manifest's digests authenticate them.
PAGES_DIR = "pages"


def page_file(first: int, attempt: str) -> str:
    """Relative to the step directory: ``pages/g00128-<attempt>.index.json``, the page of the
    group of ranks from ``first`` on."""
    return f"{PAGES_DIR}/g{first:05d}-{attempt}.index.json"


__all__ = [
    "writer_rank",
    "DATA_DIR",
    "MAX_DATA_PREFIXES",
    "data_dir",
    "data_prefixes",
    "index_file",
    "PAGES_DIR",
    "page_file",
    "LATEST_NAME",
    "PREEMPTED_NAME",
    "STEP_DIGITS",
    "STEP_PREFIX",
    "new_attempt_id",
    "parse_step_dir",
    "shard_file",
    "step_dir",
]
