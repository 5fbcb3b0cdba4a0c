"""Which key ids the committed steps of an encrypted root need (``shardkeeper keys``).

A step needs the key its manifest is sealed under (its MAC key is wrapped by it) and the key of
every data file it lists or references: an incremental save references files of earlier steps,
each sealed under the key of its own time. Read from the manifests and the files' headers, so
no key is needed. After a rotation an old key may be retired once no committed step needs it
(docs/codecs.md, "Key rotation"). Torch-free, and without the cryptography package.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardkeeper.core.codec.crypto_format import is_data_path, read_header
from shardkeeper.core.commit.committed import load_manifest, manifest_steps
from shardkeeper.core.commit.files import referenced_paths
from shardkeeper.core.errors import CheckpointError, CheckpointNotFoundError
from shardkeeper.core.storage.base import Storage

#: Encryption headers read at once (two small ranged reads each).
_THREADS = 8


@dataclass
class StepKeys:
    """The key ids one committed step needs: its manifest's, and its data files' (key id -> files)."""

    step: int
    manifest_key: str | None  # None: the step is not encrypted
    files: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return sorted(set(self.files) | ({self.manifest_key} if self.manifest_key else set()))


@dataclass
class KeyUsage:
    """``keys_needed``'s answer: per step, and per key id the steps that need it. ``unknown``:
    what could not be read (a manifest, a file's header), so the listing is incomplete and no key
    should be retired on its word."""

    root: str
    steps: list[StepKeys] = field(default_factory=list)
    unknown: list[tuple[int, str, str]] = field(default_factory=list)  # (step, path, why)
    file_keys: dict[str, str] = field(default_factory=dict)  # every data file a step needs -> its key id

    def steps_of(self) -> dict[str, list[int]]:
        """Key id -> the committed steps that need it, ascending."""
        out: dict[str, list[int]] = {}
        for s in self.steps:
            for k in s.keys:
                out.setdefault(k, []).append(s.step)
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        files: dict[str, set[str]] = {}
        for path, key in self.file_keys.items():
            files.setdefault(key, set()).add(path)
        return {
            "root": self.root,
            "keys": [
                {"key_id": k, "steps": steps, "files": len(files.get(k, ()))} for k, steps in self.steps_of().items()
            ],
            "steps": [
                {"step": s.step, "manifest_key": s.manifest_key, "keys": s.keys, "files": dict(sorted(s.files.items()))}
                for s in self.steps
            ],
            "unencrypted": [s.step for s in self.steps if s.manifest_key is None],
            "unknown": [{"step": step, "path": path, "message": why} for step, path, why in self.unknown],
        }


def keys_needed(storage: Storage) -> KeyUsage:
    """The key ids each committed step under ``storage`` (the root as stored: not an
    ``EncryptedStorage``) needs. Every manifest is read once, every data file's header once
    (a file several steps reference counts for each)."""
    usage = KeyUsage(storage.url)
    wanted: dict[int, list[str]] = {}
    for step in manifest_steps(storage):
        try:
            m = load_manifest(storage, step)
            paths = sorted(p for p in referenced_paths(step, m) if is_data_path(p))
        except CheckpointError as e:
            usage.unknown.append((step, "", f"step {step}: its manifest cannot be read: {e}"))
            continue
        section = m.encryption if isinstance(m.encryption, dict) else None
        usage.steps.append(StepKeys(step, str(section.get("key_id")) if section is not None else None))
        wanted[step] = paths if section is not None else []
    every = sorted({p for paths in wanted.values() for p in paths})
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="shardkeeper-keys") as pool:
        found = dict(zip(every, pool.map(lambda p: _key_of(storage, p), every)))
    for s in usage.steps:
        for path in wanted[s.step]:
            key, why = found[path]
            if key is None:
                usage.unknown.append((s.step, path, f"step {s.step}: {why}"))
                continue
            usage.file_keys[path] = key
            s.files[key] = s.files.get(key, 0) + 1
    return usage


def _key_of(storage: Storage, path: str) -> tuple[str | None, str]:
    """(the key id in ``path``'s encryption header, "") or (None, why it could not be read)."""
    where = storage.describe(path)
    try:
        key = read_header(storage, path)[1].get("key_id")
    except CheckpointNotFoundError:
        return None, f"file {where} is missing"
    except (CheckpointError, ValueError) as e:
        return None, f"file {where}: {e}"
    if not isinstance(key, str):
        return None, f"file {where}: its encryption header has no key id"
    return key, ""


__all__ = ["KeyUsage", "StepKeys", "keys_needed"]
