"""Commit intents and gc claims: what keeps a deleter from removing bytes that a commit in
progress is about to reference.

The invariant (docs/reliability.md, "What a save protects"): **a manifest is put only over
files that exist, and no deleter removes a file that a put manifest, or a commit whose checks
passed, references.** It needs a handshake between the coordinator of a save and every
deleter (retention, ``delete()``, ``shardkeeper gc``), in another process or not. Each side
first makes its move visible, then looks at the other's:

- the coordinator writes an *intent* (``pending.intent.<step dir>.<attempt>.json`` at the
  root: the step
  and every file its manifest will reference, its own and those of earlier steps), then checks
  that no *claim* names its step, that every earlier step it references still has its
  manifest, and that every file is there; only then does it put the manifest (within half
  the intent's lifetime), and it removes the intent afterwards;
- retention and ``delete()`` delete a step's manifest first (their claim), then read the
  intents, and keep every file an intent names;
- gc writes a claim (``pending.claim.<token>.json``, naming the step directories
  it may clean), then reads the intents, and leaves alone every step an intent is for and
  every file one names; it stops before half the claim's lifetime and removes the claim.

Whichever side moves second sees the first: the coordinator sees a claim or a deleted
manifest and fails its save (nothing is committed, nothing acknowledged), or the deleter sees
the intent and keeps the files. This needs linearizable writes, listings and reads, which
POSIX file systems, S3 and GCS provide.

A record is live while younger than the lifetime of its kind (the reader's own constants,
by the storage's clock; the ``ttl_s`` a record states is informative); a writer killed
mid-commit leaves an intent that expires by itself, and gc removes expired records.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.storage.base import Storage

#: Records are files at the root whose names start so (not a directory: on local disk an
#: empty one would be left behind, and removing it would race the next writer's mkdir).
PREFIX = "pending."
#: Lifetime of an intent: the coordinator puts its manifest within half of it (its checks
#: and the put take seconds; the other half absorbs a slow put and clock differences).
INTENT_TTL_S = 900.0
#: Lifetime of a gc claim: gc stops removing files before half of it has passed.
CLAIM_TTL_S = 900.0
_MAX_RECORD_BYTES = 256 << 20


@dataclass
class PendingRecord:
    """An intent (``kind == "intent"``: one commit in progress) or a gc claim."""

    path: str
    kind: str
    steps: list[int]
    files: set[str] = field(default_factory=set)
    ttl_s: float = INTENT_TTL_S
    age_s: float = 0.0
    #: the record could not be read: what it protects is unknown (deleters then remove nothing)
    unknown: bool = False

    @property
    def live(self) -> bool:
        return self.age_s < self.ttl_s


def write_intent(storage: Storage, step: int, attempt: str, files: Iterable[str]) -> str:
    """Announce the commit of ``step`` over ``files`` (root-relative); returns the record's path."""
    path = f"{PREFIX}intent.{step_dir(step)}.{attempt}.json"
    body = {
        "kind": "intent",
        "steps": [step],
        "attempt": attempt,
        "ttl_s": INTENT_TTL_S,
        "files": sorted(files),
        "created_at": time.time(),
    }
    storage.put(path, json.dumps(body, separators=(",", ":")).encode())
    return path


def write_claim(storage: Storage, steps: Iterable[int], by: str) -> str:
    """Announce that ``by`` (gc) may remove the files of the uncommitted ``steps``."""
    path = f"{PREFIX}claim.{secrets.token_hex(6)}.json"
    body = {"kind": "claim", "steps": sorted(steps), "by": by, "ttl_s": CLAIM_TTL_S, "created_at": time.time()}
    storage.put(path, json.dumps(body, separators=(",", ":")).encode())
    return path


def remove(storage: Storage, path: str) -> None:
    """Remove a record (best effort: a leftover expires by itself)."""
    try:
        storage.delete(path)
    except CheckpointError:
        pass


def read_records(storage: Storage, now: float | None = None) -> list[PendingRecord]:
    """Every record at the root, live or not. A record that cannot be read or parsed
    (records are written in one atomic put, so only a failing storage or a hand edit makes
    one) is ``unknown`` and live: a deleter cannot tell what it protects, so it removes nothing."""
    now = time.time() if now is None else now
    out = []
    for name in storage.list_dir(""):
        base = name.rstrip("/").rsplit("/", 1)[-1]
        if not base.endswith(".json") or not base.startswith((f"{PREFIX}intent.", f"{PREFIX}claim.")):
            continue
        path = base
        age = 0.0  # unknown: taken as young
        try:
            age = now - storage.mtime(path)
            size = storage.size(path)
            body = json.loads(storage.read_bytes(path)) if size <= _MAX_RECORD_BYTES else None
        except CheckpointNotFoundError:
            continue  # removed since listed: its commit is over
        except (CheckpointError, ValueError, RecursionError):
            body = None
        out.append(_record(path, base, body, age))
    return out


def _record(path: str, base: str, body: object, age: float) -> PendingRecord:
    kind = "intent" if base.startswith(f"{PREFIX}intent.") else "claim"
    if not isinstance(body, dict):
        return PendingRecord(path, kind, [], set(), max(INTENT_TTL_S, CLAIM_TTL_S), age, unknown=True)
    steps = [s for s in body.get("steps", []) if type(s) is int]
    files = {f for f in body.get("files", []) if isinstance(f, str)}
    # The lifetime is the reader's own: a record cannot pin its step for longer than a commit
    # (or a gc) may take, whatever it claims.
    return PendingRecord(path, kind, steps, files, INTENT_TTL_S if kind == "intent" else CLAIM_TTL_S, age)


def live_intents(storage: Storage) -> list[PendingRecord]:
    return [r for r in read_records(storage) if r.kind == "intent" and r.live]


def claimed_steps(storage: Storage) -> set[int]:
    """Steps a live gc claim names."""
    return {s for r in read_records(storage) if r.kind == "claim" and r.live for s in r.steps}


__all__ = [
    "CLAIM_TTL_S",
    "INTENT_TTL_S",
    "PREFIX",
    "PendingRecord",
    "claimed_steps",
    "live_intents",
    "read_records",
    "remove",
    "write_claim",
    "write_intent",
]
