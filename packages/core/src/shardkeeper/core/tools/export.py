"""Export a committed step as Hugging Face safetensors shards plus ``model.safetensors.index.json``.

Streaming and torch-free: the shard plan (names, dtypes, shapes, offsets) comes from the
manifest alone, so each shard's header is written first and then one tensor at a time is
assembled from its chunks and appended. Chunks are read as restore reads them
(``codec/read.py``: ranged reads, every digest block checked, then decoded). Memory is
bounded by the largest exported tensor plus one chunk, never the whole model.

Names drop the ``model/`` prefix by default, so a checkpoint of a ``transformers`` model
exports to the keys ``from_pretrained`` expects.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shardkeeper.core.codec.read import ChunkReader, size_or_none
from shardkeeper.core.commit.committed import committed_steps, load_manifest
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
)
from shardkeeper.core.format.bounds import stored_bytes_problem
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, LeafRecord, itemsize
from shardkeeper.core.format.safetensors import build_header
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.storage.safe_files import atomic_file, remove_entry, write_file
from shardkeeper.core.util.bars import make_bar

if TYPE_CHECKING:
    from typing_extensions import Buffer

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained uses ("5GB")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 2**29, ``1000`` -> 1000 (as transformers reads sizes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


@dataclass
class ExportResult:
    """What ``export_safetensors`` wrote."""

    step: int
    directory: str
    files: list[str] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)  # exported name -> file
    total_size: int = 0
    removed: list[str] = field(default_factory=list)  # files of an earlier export (overwrite=True)

    @property
    def index_path(self) -> str:
        return os.path.join(self.directory, INDEX_NAME)

    def to_json(self) -> dict[str, Any]:
        """What ``shardkeeper export --json`` prints."""
        return {
            "step": self.step,
            "directory": self.directory,
            "index": self.index_path,
            "files": list(self.files),
            "tensors": len(self.weight_map),
            "total_size": self.total_size,
            "removed": list(self.removed),
        }


#: The files an export writes (and all that ``overwrite=True`` removes from its folder).
EXPORT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.safetensors.partial",
    "*.safetensors.index.json.partial",
)


def _prepare_dir(outdir: str, overwrite: bool) -> list[str]:
    """Create ``outdir``, or check that it is empty; with ``overwrite``, remove the safetensors
    files and indexes in it (an earlier export's), and nothing else. Returns what was removed.

    A folder that holds other shards is refused: loaders that read an index follow it, but
    those that read every ``*.safetensors`` file would load stale tensors with the new ones."""
    if not os.path.exists(outdir):
        os.makedirs(outdir)
        return []
    if not os.path.isdir(outdir):
        raise NotADirectoryError(f"export to {outdir}: it is a file, not a folder; give a new or empty folder")
    entries = sorted(os.listdir(outdir))
    if not entries:
        return []
    if not overwrite:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise FileExistsError(
            f"export to {outdir}: the folder is not empty ({shown}); a loader that reads every *.safetensors "
            f"file there would mix stale shards with this export. Export into a new or empty folder, or pass "
            f"--overwrite (overwrite=True) to first remove the *.safetensors files and indexes there (other "
            f"files, such as config.json, are kept)"
        )
    removed = []
    for name in entries:
        path = os.path.join(outdir, name)
        # a link of such a name goes too, as a link (dangling or not): it is never written through
        ours = any(fnmatch.fnmatchcase(name, p) for p in EXPORT_PATTERNS)
        if ours and (os.path.islink(path) or os.path.isfile(path)):
            remove_entry(path)
            removed.append(name)
    return removed


def _select(
    m: Manifest, keys: Sequence[str], strip_prefix: str | None, where: str
) -> list[tuple[str, str, LeafRecord]]:
    """``(exported name, key, leaf)`` for every tensor leaf matching ``keys``, in key order."""
    out: list[tuple[str, str, LeafRecord]] = []
    seen: dict[str, str] = {}
    for key in sorted(m.leaves):
        if not any(fnmatch.fnmatchcase(key, p) for p in keys):
            continue
        leaf = m.leaves[key]
        if leaf.kind != "tensor":
            continue
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        if name in seen:
            raise StateMismatchError(
                f"{where}: keys {seen[name]!r} and {key!r} both export as {name!r}; keep the prefix (keep_prefix / --keep-prefix) or narrow --keys"
            )
        seen[name] = key
        out.append((name, key, leaf))
    if not out:
        raise StateMismatchError(
            f"{where}: no tensor leaf matches {' or '.join(keys)}; list the keys with `shardkeeper inspect`"
        )
    return out


def _plan_shards(items: list[tuple[str, str, LeafRecord]], max_bytes: int) -> list[list[tuple[str, str, LeafRecord]]]:
    """Greedy in key order, as transformers shards: a tensor larger than the limit goes alone."""
    shards: list[list[tuple[str, str, LeafRecord]]] = [[]]
    size = 0
    for it in items:
        n = it[2].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    return shards


def _view(a: np.ndarray) -> memoryview:
    return memoryview(cast("Buffer", a))


def _size_or_none(storage: Storage, step: int, file: str) -> int | None:
    """The size of a chunk's file, None if it is missing or its name unsafe."""
    path = resolve_file(step, file)
    return None if path is None else size_or_none(storage, path)


def _path(m: Manifest, key: str, c: ChunkRecord, where: str) -> str:
    path = resolve_file(m.step, c.file)
    if path is None:
        raise CorruptCheckpointError(f"{where}: key {key!r} names the unsafe file {c.file!r}; the manifest is damaged")
    return path


def _assemble(reader: ChunkReader, m: Manifest, key: str, leaf: LeafRecord) -> np.ndarray:
    """The whole tensor's row-major bytes (uint8), assembled from its chunks (each read
    whole: every digest block checked, decoded when encoded)."""
    storage = reader.storage
    isz = itemsize(leaf.dtype)
    nbytes = leaf.nbytes
    # The manifest alone sizes the output: before allocating it, check that the files hold
    # the chunks (validation bounded what each chunk's stored bytes decode to).
    why = stored_bytes_problem(leaf.chunks, lambda file: _size_or_none(storage, m.step, file))
    if why is not None:
        raise CorruptCheckpointError(
            f"step {m.step} under {storage.url}: key {key!r} ({nbytes} bytes) cannot be exported: {why}; the "
            f"checkpoint is damaged: export another step and run `shardkeeper verify {storage.url} {m.step}`"
        )
    out = np.empty(nbytes, dtype=np.uint8)
    grid = out.reshape(*leaf.shape, isz) if leaf.shape else out.reshape(isz)
    for c in leaf.chunks:
        raw_len = c.numel * isz
        if c.encoding == "raw" and c.length != raw_len:
            raise CorruptCheckpointError(
                f"step {m.step}: chunk of {key!r} holds {c.length} bytes for {c.numel} elements"
            )
        # A box spanning every dimension but the first is contiguous in the output: read it
        # straight there; any other box goes through one scratch buffer of its own size.
        if leaf.shape and tuple(c.shape[1:]) == tuple(leaf.shape[1:]):
            start = c.offsets[0] * math.prod(leaf.shape[1:]) * isz
            reader.read_chunk(_path(m, key, c, reader.where), c, _view(out)[start : start + raw_len], key, isz)
            continue
        scratch = np.empty(raw_len, dtype=np.uint8)
        reader.read_chunk(_path(m, key, c, reader.where), c, _view(scratch), key, isz)
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape, strict=True))
        grid[box] = scratch.reshape(*c.shape, isz) if c.shape else scratch
    return out


def export_safetensors(
    root: str | os.PathLike[str] | Storage,
    step: int | None = None,
    *,
    to: str | os.PathLike[str],
    keys: Sequence[str] = ("model/*",),
    keep_prefix: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    encryption: Any = None,
    encryption_root: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the tensor leaves of ``step`` (default: the newest committed) matching ``keys`` to
    the local directory ``to`` as ``model-0000i-of-0000n.safetensors`` + the index.

    Names lose the ``model/`` prefix unless ``keep_prefix``; ``max_shard_size`` ("5GB", bytes)
    bounds each shard (a larger tensor gets a shard of its own). Files appear under their final
    names only when complete; the index is written last. ``progress``: a progress bar on
    stderr, by bytes (default: when stderr is a terminal). ``encryption``: the key of an encrypted
    checkpoint (as ``CheckpointManager(encryption=...)``); its bytes are decrypted;
    ``encryption_root``: the root it was written under, if it was moved or copied since.
    ``to`` must be new or empty (``FileExistsError`` otherwise, before anything is read);
    ``overwrite=True`` first removes the ``*.safetensors`` files and indexes in it, only those.
    """
    storage = _open(root, storage_options, encryption, encryption_root)
    step, m, where = _load_step(storage, step)
    items = _select(m, list(keys), None if keep_prefix else "model/", where)
    limit = parse_size(max_shard_size)
    if limit < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    shards = _plan_shards(items, limit)
    outdir = os.fspath(to)
    removed = _prepare_dir(outdir, overwrite)
    res = ExportResult(step=step, directory=outdir, removed=removed)
    reader = ChunkReader.of(
        storage, m, where=where, remedy=f"export another step and run `shardkeeper verify {storage.url}`"
    )
    bar = make_bar(sum(it[2].nbytes for it in items), f"export step {step}", progress)
    # Every file is written by ``atomic_file``: a temporary created anew (a link planted at
    # its name is unlinked, never written through), renamed over the final name (a link there
    # is replaced); so nothing lands outside ``outdir``, even if links appear there meanwhile.
    try:
        meta = {"format": "pt", "shardkeeper_root": storage.url, "shardkeeper_step": str(step)}
        _write_shards(shards, reader, m, meta, res, bar)
        _write_index(res)
    except BaseException:
        # a failed export leaves its folder as it found it (empty, or emptied by overwrite=True):
        # no half-written shard, no shard without an index, and nothing to overwrite next time
        for fname in res.files:
            with contextlib.suppress(OSError):
                remove_entry(os.path.join(outdir, fname))
        raise
    finally:
        bar.close()
    return res


def _open(
    root: str | os.PathLike[str] | Storage,
    storage_options: Mapping[str, Any] | None,
    encryption: Any,
    encryption_root: str | None,
) -> Storage:
    """The storage at ``root``; with ``encryption``, one that decrypts and authenticates."""
    storage = open_storage(root, **dict(storage_options or {}))
    if encryption is not None:
        from shardkeeper.core.codec.crypto import EncryptedStorage
        from shardkeeper.core.codec.keys import key_provider

        provider = key_provider(encryption)
        assert provider is not None
        storage = EncryptedStorage(storage, provider, root=encryption_root).authenticated()
    return storage


def _load_step(storage: Storage, step: int | None) -> tuple[int, Manifest, str]:
    """``step`` (None: the newest committed), its manifest, and the words that name it; an
    encrypted step read without its key is refused."""
    if step is None:
        steps = committed_steps(storage)
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url} to export")
        step = steps[-1]
    m = load_manifest(storage, step)
    where = f"step {step} under {storage.url}"
    if m.encryption is not None and not getattr(storage, "authenticate", False):
        from shardkeeper.core.codec.keys import EncryptionKeyError

        raise EncryptionKeyError(
            f"{where} is encrypted (key {m.encryption.get('key_id')}); pass its key: "
            f"export_safetensors(..., encryption='env:VAR' | 'file:PATH' | a KeyProvider)"
        )
    return step, m, where


def _write_shards(
    shards: list[list[tuple[str, str, LeafRecord]]],
    reader: ChunkReader,
    m: Manifest,
    meta: dict[str, str],
    res: ExportResult,
    bar: Any,
) -> None:
    """Write each shard into ``res.directory`` (its header, then one assembled tensor at a
    time), recording its file, names and bytes in ``res``."""
    n = len(shards)
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        header, _ = build_header([(name, leaf.dtype, leaf.shape, leaf.nbytes) for name, _, leaf in shard], meta)
        final = os.path.join(res.directory, fname)
        with atomic_file(final, final + ".partial") as f:
            f.write(header)
            for name, key, leaf in shard:
                data = _assemble(reader, m, key, leaf)
                f.write(_view(data))
                del data
                res.weight_map[name] = fname
                res.total_size += leaf.nbytes
                bar.update(leaf.nbytes)
        res.files.append(fname)


def _write_index(res: ExportResult) -> None:
    """Write the index of the shards ``res`` records, last."""
    index = {
        "metadata": {"total_size": res.total_size, "shardkeeper_step": res.step},
        "weight_map": dict(sorted(res.weight_map.items())),
    }
    final = os.path.join(res.directory, INDEX_NAME)
    write_file(final, (json.dumps(index, indent=2) + "\n").encode(), tmp=final + ".partial")


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "EXPORT_PATTERNS",
    "INDEX_NAME",
    "ExportResult",
    "export_safetensors",
    "parse_size",
]
