"""The files of a root: where a manifest's file entries point, and walking and removing what
lies in step directories (retention, gc and the commit's checks share these rules).

Torch-free.
"""

from __future__ import annotations

import posixpath

from shardkeeper.core.commit.committed import load_manifest, manifest_steps
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError, StorageError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import MANIFEST_NAME, Manifest
from shardkeeper.core.storage.base import Storage, is_empty_dir

# Names the format gives to files (never to directories): walk_files does not list them.
_FILE_SUFFIXES = (".safetensors", ".index.json", ".tmp", MANIFEST_NAME)

# How deep ``walk_files`` descends below a step directory (the layout uses one level: data/).
_MAX_DEPTH = 8


# --------------------------------------------------------------------------------------------
# Paths


def resolve_file(step: int, rel: str) -> str | None:
    """Root-relative path of a manifest ``file`` entry of ``step``, or None if it is invalid.

    ``rel`` is relative to the step directory and may climb into another step directory
    (``../step-000000001100/data/r00000-ab12cd34-000.safetensors``); a path that leaves the
    root, or is absolute, is invalid.
    """
    if not rel or rel.startswith("/") or "\\" in rel:
        return None
    path = posixpath.normpath(f"{step_dir(step)}/{rel}")
    if path in (".", "..") or path.startswith("../") or path.startswith("/"):
        return None
    return path


def referenced_paths(step: int, manifest: Manifest) -> set[str]:
    """Root-relative paths of every file ``manifest`` (of ``step``) lists or points a chunk at."""
    out = set()
    for rel in manifest.referenced_files():
        path = resolve_file(step, rel)
        if path is not None:
            out.add(path)
    return out


def _base(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def walk_files(storage: Storage, path: str, _depth: int = 0, *, unwalked: list[str] | None = None) -> list[str]:
    """Every file under the directory ``path`` (root-relative paths), sorted.

    Names the format gives to files (``*.safetensors``, ``*.index.json``, ``*.tmp``,
    ``manifest.json``) are files, without a request each, unless the storage's ``subdirs``
    (local disk: the listing's entry types) says the entry is a directory; for any other name,
    an entry with entries of its own is a directory, and one without is an entry of its own: a file, or an empty
    directory or folder marker (``listed_dir`` tells them apart). A local symbolic link lists
    as empty (``LocalStorage`` never lists through one), so it is an entry too, and deleting
    it deletes the link, never what it points at. A directory with entries ``_MAX_DEPTH``
    levels down is deeper than any layout: it is not listed (nothing judges it by its own age
    or removes it alone; it goes with its step directory), but added to ``unwalked`` if given.
    """
    out: list[str] = []
    subdirs = getattr(storage, "subdirs", None)
    dirs: set[str] = subdirs(path) if subdirs is not None else set()
    for raw in storage.list_dir(path):
        name = _base(raw)
        if not name or name in (".", ".."):
            continue
        child = f"{path}/{name}" if path else name
        if name.endswith(_FILE_SUFFIXES) and name not in dirs:
            out.append(child)  # files by the format's naming: no request each (a listing on S3)
            continue
        if _has_entries(storage, child, name):
            if _depth < _MAX_DEPTH:
                out.extend(walk_files(storage, child, _depth + 1, unwalked=unwalked))
            elif unwalked is not None:
                unwalked.append(child)
        else:
            out.append(child)
    return sorted(out)


def _has_entries(storage: Storage, path: str, name: str) -> bool:
    """Whether ``path`` (named ``name``) lists entries of its own: a directory that is not empty."""
    try:
        sub = storage.list_dir(path)
    except CorruptCheckpointError:
        return False  # cannot be listed for what it is (a symlink loop...): an entry, as a file
    # Some object-store listings return the object itself when asked to list a file.
    return bool(sub) and [_base(s) for s in sub] != [name]


def listed_dir(storage: Storage, path: str) -> bool:
    """Whether an entry ``walk_files`` listed is an empty directory (POSIX) or a folder marker
    (an object store's zero-byte ``path/`` object), not a file: names the format gives to
    files are files without asking the storage."""
    if path.endswith(_FILE_SUFFIXES) and getattr(storage, "subdirs", None) is None:
        return False  # (no request per file where the walk took such names for files)
    return is_empty_dir(storage, path) and not _has_entries(storage, path, _base(path))


def remove_file(storage: Storage, path: str, is_dir: bool | None = None) -> bool:
    """Delete an entry ``walk_files`` listed: a file, or an empty directory or folder marker
    (``listed_dir``, unless the caller already asked: ``is_dir``), which is deleted as a
    directory. True for a directory."""
    if listed_dir(storage, path) if is_dir is None else is_dir:
        storage.delete_dir(path)
        return True
    try:
        storage.delete(path)
    except (StorageError, CorruptCheckpointError):  # EISDIR is damage to a reader
        if not storage.capabilities.directories or _has_entries(storage, path, _base(path)):
            raise  # a directory with entries is never removed as one entry
        storage.delete_dir(path)  # an empty directory of a storage without ``is_dir``
        return True
    return False


def size_or_zero(storage: Storage, path: str) -> int:
    """The bytes removing the entry ``path`` frees, for reports: a file's size; 0 for a
    symbolic link (only the link goes) and for an entry that cannot be read."""
    try:
        is_link = getattr(storage, "is_link", None)
        return 0 if is_link is not None and is_link(path) else storage.size(path)
    except CheckpointError:
        return 0


def committed_since(storage: Storage, known: set[int]) -> tuple[set[int], set[str]]:
    """Steps that have a manifest now but are not in ``known`` (a deleter's earlier listing),
    and every file their manifests reference. A deleter calls it after reading the intents of
    commits in progress (commit/intents.py): a commit whose intent it no longer sees put its manifest
    before removing the intent, so it is listed here. A manifest that does not validate counts
    too, with no references: its step is left alone. A valid manifest whose pages cannot be
    read raises: what it references is unknown."""
    steps: set[int] = set()
    refs: set[str] = set()
    for s in manifest_steps(storage):
        if s in known:
            continue
        steps.add(s)
        try:
            m = load_manifest(storage, s)
        except CheckpointError:
            continue
        try:
            refs |= referenced_paths(s, m)
        except CheckpointError as e:  # a page: the step's references are unknown, so delete nothing
            raise CorruptCheckpointError(
                f"step {s} under {storage.url} was committed while files were being deleted, and the files it "
                f"references cannot all be read ({e}); nothing more was deleted: run `shardkeeper verify` on it"
            ) from e
    return steps, refs


__all__ = [
    "committed_since",
    "listed_dir",
    "referenced_paths",
    "remove_file",
    "resolve_file",
    "size_or_zero",
    "walk_files",
]
