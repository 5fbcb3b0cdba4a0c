"""What "committed" means, in one place. Load, discovery, retention and the CLI all use it.

A checkpoint is committed if and only if its manifest exists and validates. Manifests are
written once, atomically, and last, so a step directory without one is a save in flight or
the leftover of a failed one: never visible to readers.
"""

from __future__ import annotations

import logging

import xxhash

from shardkeeper.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleFormatError,
)
from shardkeeper.core.format import manifest as manifest_format
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import LATEST_NAME, parse_step_dir, step_dir
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.storage.base import Storage

log = logging.getLogger(__name__)


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def manifest_digest(storage: Storage, step: int) -> str | None:
    """A short digest of ``step``'s manifest bytes as stored (xxh3-64), or None when it
    cannot be read: two copies of a step (two nodes' local tiers) agree when it matches."""
    try:
        return xxhash.xxh3_64_hexdigest(storage.read_bytes(manifest_path(step)))
    except CheckpointError:
        return None


def step_dirs(storage: Storage) -> dict[int, str]:
    """Every step directory under the root, committed or not: step -> directory name."""
    out = {}
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None:
            out[step] = name.rstrip("/").rsplit("/", 1)[-1]
    return out


def load_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of ``step``; raises if the step is not committed or is damaged."""
    path = manifest_path(step)
    try:
        size = storage.size(path)
        if size > manifest_format.MAX_MANIFEST_BYTES:  # refused before a byte is read
            raise CorruptCheckpointError(manifest_format.too_large(storage.describe(path), size))
        data = storage.read_bytes(path)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"step {step} is not committed under {storage.url}: no {MANIFEST_NAME} at "
            f"{storage.describe(path)}; list committed steps with `shardkeeper ls {storage.url}`"
        ) from None
    m = Manifest.loads(data, where=storage.describe(path))
    if m.step != step:
        raise CorruptCheckpointError(
            f"manifest {storage.describe(path)} says step {m.step}, its directory says {step}; "
            f"the root was edited by hand: restore another step"
        )
    attach_index_files(storage, m)
    return m


def attach_index_files(storage: Storage, m: Manifest) -> None:
    """Let ``m``'s described leaves (format.md 3.8) read their index files from ``storage``."""
    described = getattr(m.leaves, "described", None)
    if described is None:
        return
    sdir = step_dir(m.step)
    fn = digest_function(m.digest_algorithm)

    def read(rel: str, size: int) -> bytes:
        path = f"{sdir}/{rel}"
        if storage.size(path) != size:  # never read a file that is not what the manifest says
            return b""
        return storage.read_range(path, 0, size) if size else b""

    described.attach(read, lambda data: fn(data), m.files, lambda rel: storage.describe(f"{sdir}/{rel}"), m.step)


def is_committed(storage: Storage, step: int) -> bool:
    """The definition: the manifest exists and validates (a newer format still counts)."""
    try:
        load_manifest(storage, step)
    except IncompatibleFormatError:
        return True
    except CheckpointError:
        return False
    return True


def lists_manifest(storage: Storage, name: str) -> bool:
    """Whether the step directory ``name`` lists a manifest. A directory that cannot be
    listed for what it is (damage: a symlink loop, a name too long) lists none, with a
    warning, so that one bad entry does not break the listing of the root; a storage
    failure (``StorageError``) is raised."""
    try:
        names = storage.list_dir(name)
    except CorruptCheckpointError as e:
        log.warning("step directory %s cannot be listed, so its step is not committed: %s", storage.describe(name), e)
        return False
    return MANIFEST_NAME in [n.rstrip("/").rsplit("/", 1)[-1] for n in names]


def manifest_steps(storage: Storage) -> list[int]:
    """Steps whose directory holds a manifest, ascending, found by listing alone: the
    committed ones plus any whose manifest is damaged. For callers that load the manifest
    they pick anyway (restore tries the newest first and falls back on damage), so that
    finding the newest step does not read and validate every manifest of the root."""
    return [step for step, name in sorted(step_dirs(storage).items()) if lists_manifest(storage, name)]


def newest_committed(storage: Storage) -> int | None:
    """The newest committed step (None: none), validating manifests newest first only until
    one validates, not every manifest of the root."""
    for step in reversed(manifest_steps(storage)):
        if is_committed(storage, step):
            return step
    return None


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps under the root, ascending (every manifest is read and validated)."""
    steps = []
    for step in manifest_steps(storage):
        if is_committed(storage, step):
            steps.append(step)
        else:
            log.warning("step %d under %s has a manifest that does not validate; ignored", step, storage.url)
    return steps


def write_latest_hint(storage: Storage, step: int) -> None:
    """LATEST is a hint for humans and fast tools; readers never trust it over the manifests."""
    storage.put(LATEST_NAME, f"{step}\n".encode())


__all__ = [
    "attach_index_files",
    "committed_steps",
    "is_committed",
    "lists_manifest",
    "load_manifest",
    "manifest_digest",
    "manifest_path",
    "manifest_steps",
    "newest_committed",
    "step_dirs",
    "write_latest_hint",
]
