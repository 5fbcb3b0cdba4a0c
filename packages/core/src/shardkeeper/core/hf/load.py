"""``load_hf``: a Hugging Face safetensors folder read into a target state, sharded or not, by
restore's own machinery.

The folder (hf/folder.py) is presented as a manifest of whole-tensor chunks under the
target's keys (hf/view.py, where the declared transformations apply), and ``restore_flat``
fills the target from it as from a committed step: each rank plans the overlaps of its pieces
(a DTensor's local shard, a ZeRO fragment, a plain tensor whole) with those chunks and reads
only those byte ranges, straight into the target where it can; a range several ranks need is
read from storage once and sent to the others (``restore/share.py``); keys, shapes and
dtypes are checked before a tensor byte is read. No pickle anywhere, and no digests (the
format has none): bytes are used as read. A collective over the process group, as a restore.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.config.settings import options_from_env
from shardkeeper.core.errors import CheckpointNotFoundError, CheckpointRestoreError, StateMismatchError
from shardkeeper.core.hf.folder import REMEDY, Folder, Tensor
from shardkeeper.core.hf.view import Rename, as_manifest, select, target_keys
from shardkeeper.core.restore.flat import TargetWrites, restore_flat
from shardkeeper.core.restore.plan import RestoreStats, listing
from shardkeeper.core.restore.share import PeerExchangeError, ReadShare, peer_group
from shardkeeper.core.runtime.coordinator import make_coordinator
from shardkeeper.core.state.flatten import FlatState, as_torch, flatten_for_restore, torch_dtype_name
from shardkeeper.core.state.tied import tied_aliases
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage
from shardkeeper.core.storage.retry import with_retries

#: How errors name what ``load_hf`` reads.
SOURCE = "Hugging Face folder"


@dataclass(frozen=True)
class HFLoad:
    """What ``load_hf`` did on this rank."""

    keys: dict[str, str]
    """Target key -> the folder's tensor it was filled from (a tied alias's twin)."""
    unused: list[str]
    """The folder's tensors (selected by ``only``, kept by ``rename``) that fill no key of the target."""
    stats: RestoreStats
    """This rank's reads: ``bytes_read`` from storage, ``bytes_received`` from peers."""


def open_folder(
    path: str | os.PathLike[str] | Storage, storage_options: Mapping[str, Any] | None, options: CheckpointOptions
) -> tuple[Storage, str]:
    """The storage to read and the folder in it (""; its root). A local Hub cache folder,
    ``models--org--name`` or its ``snapshots/<revision>``, is opened at the repository folder,
    so that the snapshot's links into ``blobs/`` stay inside the storage's root."""
    if not isinstance(path, (str, os.PathLike)):
        return with_retries(path, options.retry_policy()), ""
    text = os.fspath(path)
    opts = dict(storage_options or {})
    folder = ""
    if "://" not in text or text.startswith("file://"):
        local = Path(text.removeprefix("file://")).expanduser()
        ref = local / "refs" / "main"
        if (local / "snapshots").is_dir() and ref.is_file():
            rev = ref.read_text().strip()
            if not rev or "/" in rev or rev.startswith(".") or not (local / "snapshots" / rev).is_dir():
                raise CheckpointNotFoundError(
                    f"{ref} names {rev[:80]!r}, not a revision folder under {local / 'snapshots'}: the Hub cache "
                    f"is damaged or was edited; pass the snapshot folder itself (snapshots/<revision>), or "
                    f"download it again (huggingface_hub.snapshot_download(..., force_download=True))"
                )
            folder = f"snapshots/{rev}"
        elif local.parent.name == "snapshots" and (local.parent.parent / "blobs").is_dir():
            local, folder = local.parent.parent, f"snapshots/{local.name}"
        if not local.is_dir():
            raise CheckpointNotFoundError(f"no such folder: {local} (load_hf reads a Hugging Face safetensors folder)")
        text = str(local)
    return with_retries(open_storage(text, **opts), options.retry_policy()), folder


def _check_dtypes(
    flat: FlatState,
    keys: Mapping[str, str],
    tensors: Mapping[str, Tensor],
    dtype: bool | torch.dtype | None,
    where: str,
) -> None:
    """Refuse, before any read, a tensor the format cannot hold and a dtype change ``dtype``
    does not allow (True: any, a ``torch.dtype``: into targets of that dtype)."""
    unknown, wrong = [], []
    for key, name in keys.items():
        t = tensors[key]
        if t.dtype is None:
            unknown.append(f"{name!r} ({t.code})")
            continue
        have = torch_dtype_name(as_torch(flat.leaves[key].value).dtype)
        if have != t.dtype and not (
            dtype is True or (isinstance(dtype, torch.dtype) and have == torch_dtype_name(dtype))
        ):
            wrong.append(f"{key!r}: file {t.dtype}, target {have}")
    if unknown:
        raise StateMismatchError(
            f"{len(unknown)} tensor(s) of {where} have a dtype shardkeeper does not read: {listing(unknown, 8)}; "
            f"a quantized checkpoint needs dequantizing first (its own library's loader), or leave them out "
            f"with only=[...]; nothing was read"
        )
    if wrong:
        raise StateMismatchError(
            f"{len(wrong)} tensor(s) of {where} have another dtype than the target: {listing(wrong, 8)}; pass "
            f"dtype=True to cast each to its target's dtype (restore's cast_dtypes=True), or dtype=<the "
            f"target's dtype>; nothing was read"
        )


def _plan(
    folder: Folder,
    flat: FlatState,
    *,
    rename: Rename,
    prefix: str,
    tied: Mapping[str, str] | None,
    only: Sequence[str] | None,
    strict: bool,
    dtype: bool | torch.dtype | None,
    where: str,
) -> tuple[dict[str, str], dict[str, Tensor], list[str]]:
    """Target key -> source name, target key -> the tensor read, and the unused source names;
    ``flat`` keeps only the leaves to fill (the target's tensors under ``prefix``, those
    ``only`` selects; tied aliases are filled through their twin)."""
    sources = select(folder.weight_map, tied, only, where)
    renamed = target_keys(sources, rename, prefix, where)
    targets = [k for k, leaf in flat.leaves.items() if leaf.kind == "tensor" and k.startswith(prefix)]
    keys = {k: renamed[k] for k in targets if k in renamed}  # target key -> source name
    unused = sorted(set(renamed.values()) - set(keys.values()))  # (not the names rename= dropped)
    if not keys:
        raise StateMismatchError(
            f"no tensor of {where} is a key of the target state: the folder's {listing(sorted(renamed), 3)} "
            f"(after rename= and prefix={prefix!r}), the target's {listing(targets, 3)}; nothing was read. "
            f"Map the names with rename= or prefix="
        )
    wanted = set(keys) if only else set(targets)
    aliases = tied_aliases(flat.ties, wanted - set(keys), keys)
    missing = sorted(wanted - set(keys) - set(aliases))
    if missing:
        text = (
            f"{len(missing)} tensor(s) of the target state are not in {where}: {listing(missing, 8)}; unused "
            f"in the folder: {listing(unused, 8) if unused else 'none'}"
        )
        if strict:
            raise StateMismatchError(
                f"{text}. Map names with rename=, fill an omitted tied weight with tied={{alias: name}}, "
                f"or pass strict=False to leave them as they are; nothing was read"
            )
        warnings.warn(f"strict=False: {text}; they keep their current values", stacklevel=3)
    flat.leaves = {k: flat.leaves[k] for k in keys}
    flat.optimizers = {}  # a folder of weights restores no optimizer state: nothing to check it against
    tensors = folder.tensors({sources[n] for n in keys.values()})
    by_key = {k: tensors[sources[n]] for k, n in keys.items()}
    _check_dtypes(flat, keys, by_key, dtype, where)
    return {k: sources[n] for k, n in keys.items()}, by_key, unused


def _target(
    state: Mapping[str, Any] | nn.Module, prefix: str | None, dtype: object, rename: object
) -> tuple[Mapping[str, Any], str]:
    """The target mapping and the prefix of its keys (``"model/"`` for a module by default);
    a ``TypeError`` for arguments of the wrong kind."""
    if isinstance(state, nn.Module):
        state, prefix = {"model": state}, "model/" if prefix is None else prefix
    if not isinstance(state, Mapping):
        raise TypeError(f"load_hf(path, state): state must be an nn.Module or a mapping, not {type(state).__name__}")
    if not (dtype is None or isinstance(dtype, (bool, torch.dtype))):
        raise TypeError(f"dtype must be None, a bool or a torch.dtype, not {type(dtype).__name__}")
    if rename is not None and not (callable(rename) or isinstance(rename, Mapping)):
        raise TypeError(f"rename must be a mapping or a function of a name, not {type(rename).__name__}")
    return state, prefix or ""


def load_hf(
    path: str | os.PathLike[str] | Storage,
    state: Mapping[str, Any] | nn.Module,
    *,
    rename: Rename = None,
    dtype: bool | torch.dtype | None = None,
    only: str | Sequence[str] | None = None,
    tied: Mapping[str, str] | None = None,
    prefix: str | None = None,
    strict: bool = True,
    process_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    options: CheckpointOptions | None = None,
) -> HFLoad:
    """Fill ``state`` in place from the Hugging Face safetensors folder at ``path``.

    ``path``: a local folder (a Hub cache repository folder or snapshot too), an fsspec URL or
    a ``Storage``. ``state``: a module, or a mapping as ``CheckpointManager.restore`` takes; its
    tensors (plain, DTensors of FSDP2/TP, ZeRO fragments) are filled in place, each rank reading
    the byte ranges its pieces need. Transformations (hf/view.py): ``tied`` (``{alias: name}``
    for a tensor the folder omits), ``only`` (patterns of the folder's names), ``rename``
    (mapping or function, to target keys; a function returning None drops a name) and
    ``prefix`` (before every key; default ``"model/"`` for a module, else ""). ``dtype``: None,
    every dtype must match; True, cast each tensor to its target's dtype; a ``torch.dtype``,
    cast into the targets of that dtype. ``strict``: target tensors the folder lacks are an
    error (False: a warning, they keep their values). ``options``: the I/O and restore options
    (``io_threads``, ``max_read_bytes``, ``share_restore_reads``, retries); by default
    ``CheckpointOptions`` with the ``SHARDKEEPER_<NAME>`` variables applied
    (``options_from_env``), as an adapter reads them. A collective over ``process_group``
    (default: the world when initialized).
    """
    state, prefix = _target(state, prefix, dtype, rename)
    patterns = [only] if isinstance(only, str) else (list(only) if only else None)
    opts = options if options is not None else CheckpointOptions(**options_from_env())
    storage, dir = open_folder(path, storage_options, opts)
    coord = make_coordinator(process_group)
    rank, world = coord.rank, coord.world_size
    where = f"{storage.describe(dir)} (rank {rank})"
    share = None
    if world > 1 and coord.agree_int(int(opts.share_restore_reads), "min"):
        share = ReadShare(peer_group(coord, opts.commit_timeout_s), rank, world, 0)
    writes = TargetWrites()
    error: BaseException | None = None
    result: HFLoad | None = None
    with ThreadPoolExecutor(opts.io_threads, thread_name_prefix="shardkeeper-io") as io:
        try:
            flat = flatten_for_restore(state, rank, strict=strict)
            folder = Folder(storage, dir, rank=rank)
            keys, tensors, unused = _plan(
                folder,
                flat,
                rename=rename,
                prefix=prefix,
                tied=tied,
                only=patterns,
                strict=strict,
                dtype=dtype,
                where=where,
            )
            stats = _fill(storage, dir, folder, tensors, flat, rank, world, bool(dtype), io, opts, writes, share)
            result = HFLoad(keys, unused, stats)
        except BaseException as e:
            error = e
        finally:
            if share is not None:
                share.finish()
    return _outcome(result, error, coord, writes, storage.describe(dir))


def _fill(
    storage: Storage,
    dir: str,
    folder: Folder,
    tensors: Mapping[str, Tensor],
    flat: FlatState,
    rank: int,
    world: int,
    cast: bool,
    io: ThreadPoolExecutor,
    opts: CheckpointOptions,
    writes: TargetWrites,
    share: ReadShare | None,
) -> RestoreStats:
    """``flat`` filled from ``tensors`` (target key -> the folder's tensor) by restore's
    machinery, unverified (the format has no digests)."""
    return restore_flat(
        storage,
        dir,
        as_manifest(tensors, folder.sizes),
        flat,
        rank=rank,
        world_size=world,
        only=None,
        strict=True,
        per_rank="exact",
        cast=cast,
        executor=io,
        max_read_bytes=opts.max_read_bytes,
        writes=writes,
        share=share,
        source=SOURCE,
        remedy=REMEDY,
        verify=False,
    )


def _outcome(
    result: HFLoad | None, error: BaseException | None, coord: Any, writes: TargetWrites, folder: str
) -> HFLoad:
    """``result``, once every rank succeeded (a collective, unless the exchange with the peers
    failed: then they may be gone); else this rank's error, or one saying another rank failed."""
    if (
        isinstance(error, PeerExchangeError)
        or coord.world_size == 1
        or not coord.agree_int(int(error is not None), "max")
    ):
        if error is not None:
            raise _partly(error, writes)
        assert result is not None
        return result
    if error is None:
        error = CheckpointRestoreError(
            f"load_hf of {folder} failed on another rank (rank {coord.rank} succeeded); see that rank's error"
        )
    raise _partly(error, writes)


def _partly(err: BaseException, writes: TargetWrites) -> BaseException:
    """``err``, with a note when reads wrote into the target before it (Python >= 3.11)."""
    if writes.keys and hasattr(err, "add_note"):
        err.add_note(
            f"The target is partly loaded: {len(writes.keys)} of its keys were written before the load failed; "
            f"do not train from it: load again or rebuild it"
        )
    return err


__all__ = ["SOURCE", "HFLoad", "load_hf", "open_folder"]
