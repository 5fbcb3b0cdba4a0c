"""Names on storage: step directories, shard files, the LATEST hint."""

from __future__ import annotations

import re
import secrets

STEP_PREFIX = "step-"
STEP_DIGITS = 12
LATEST_NAME = "LATEST"
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


def shard_file(rank: int, attempt: str, index: int) -> str:
    """Relative to the step directory: ``data/r00000-<attempt>-000.safetensors``."""
    return f"{DATA_DIR}/r{rank:05d}-{attempt}-{index:03d}.safetensors"


def index_file(rank: int, attempt: str) -> str:
    """Relative to the step directory: ``data/r00000-<attempt>.index.json``, a rank's chunks
    of described leaves (format_version 7)."""
    return f"{DATA_DIR}/r{rank:05d}-{attempt}.index.json"


__all__ = [
    "DATA_DIR",
    "index_file",
    "LATEST_NAME",
    "STEP_DIGITS",
    "STEP_PREFIX",
    "new_attempt_id",
    "parse_step_dir",
    "shard_file",
    "step_dir",
]
