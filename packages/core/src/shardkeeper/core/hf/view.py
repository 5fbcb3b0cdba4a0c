"""A safetensors folder seen through declared transformations, as the manifest restore reads.

The transformations are data, applied to names before anything is read, in this order:

1. ``tied``: ``{alias: name}`` gives a tensor the file omits the bytes of another
   (``{"lm_head.weight": "model.embed_tokens.weight"}``: what ``save_pretrained`` leaves out
   of a model with tied embeddings); a name the file holds keeps its own bytes;
2. ``only``: patterns of source names (globs, ``/``-prefixes, names) keep a subset;
3. ``rename``: a mapping (names it lacks stay as they are) or a function (None drops the
   name) from source name to target key, then ``prefix`` before it (``"model/"`` for the
   ``{"model": module}`` form of a state); every ``/``-part FQN-normalized as the target's
   keys are. Two names that become one key are refused.

``as_manifest`` then presents the chosen tensors under their target keys: one whole-tensor
chunk each, pointing at its byte range in its file. A tie's alias and its twin share one
chunk. The folder records no digests: each chunk carries its location instead, so that
restore's check of tied weights (``state/tied.py``) compares locations, and it is read
unverified (``ChunkReader.verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.digest import DEFAULT_ALGORITHM
from shardkeeper.core.format.manifest import ChunkRecord, LeafRecord, Manifest
from shardkeeper.core.hf.folder import Tensor
from shardkeeper.core.restore.plan import listing, matches
from shardkeeper.core.state.flatten import normalize_fqn

#: ``rename=``: a mapping of source names to target keys, or a function (None: leave it out).
Rename = Mapping[str, str] | Callable[[str], str | None] | None


def select(
    names: Iterable[str], tied: Mapping[str, str] | None, only: Sequence[str] | None, where: str
) -> dict[str, str]:
    """Source name -> the file's tensor it reads: the folder's ``names``, each tie's alias the
    folder lacks, kept where ``only`` matches (``only`` matching none is an error)."""
    present = list(names)
    out = {n: n for n in present}
    for alias, twin in (tied or {}).items():
        if alias in out:
            continue  # the file holds it: its own bytes
        if twin not in out:
            raise StateMismatchError(
                f"tied={{{alias!r}: {twin!r}}}: {where} holds no tensor {twin!r} to fill {alias!r} from; "
                f"name a tensor of its index (e.g. {listing(sorted(present)[:3], 3)})"
            )
        out[alias] = twin
    if only:
        out = {n: f for n, f in out.items() if matches(n, only)}
        if not out:
            raise StateMismatchError(
                f"only={list(only)} matches no tensor of {where}; nothing was read. Its tensors: "
                f"{listing(sorted(present), 6)}"
            )
    return out


def _renamed(name: str, rename: Rename) -> str | None:
    if rename is None:
        return name
    if callable(rename):
        new = rename(name)
        if new is not None and not isinstance(new, str):
            raise TypeError(f"rename({name!r}) returned a {type(new).__name__}; it must return a str or None")
        return new
    return rename.get(name, name)


def target_keys(names: Iterable[str], rename: Rename, prefix: str, where: str) -> dict[str, str]:
    """Target key -> source name, for each of ``names`` that ``rename`` keeps."""
    out: dict[str, str] = {}
    for name in names:
        new = _renamed(name, rename)
        if new is None:
            continue
        key = "/".join(normalize_fqn(p) for p in (prefix + new).split("/"))
        if key in out:
            raise StateMismatchError(
                f"{where}: tensors {out[key]!r} and {name!r} both become the target key {key!r} (after "
                f"rename= and prefix={prefix!r}; wrapper parts such as 'module.' are dropped); nothing was "
                f"read. Rename one of them, or leave one out with only=[...]"
            )
        out[key] = name
    return out


def as_manifest(tensors: Mapping[str, Tensor], sizes: Mapping[str, int]) -> Manifest:
    """``tensors`` (target key -> the tensor it reads) as a manifest of one whole-tensor chunk
    each; dtypes the format lacks must have been refused before (``Tensor.dtype``)."""
    leaves: dict[str, LeafRecord] = {}
    for key, t in tensors.items():
        assert t.dtype is not None
        chunks: tuple[ChunkRecord, ...] = ()
        if t.length:
            where = f"{t.file}@{t.offset}+{t.length}"  # in place of digests: see the module's docstring
            chunks = (ChunkRecord(t.file, t.offset, t.length, (0,) * len(t.shape), t.shape, (where,)),)
        leaves[key] = LeafRecord("tensor", t.dtype, t.shape, chunks)
    return Manifest(
        step=0,
        world_size=1,
        leaves=leaves,
        files={f: {"size_bytes": s, "rank": 0} for f, s in sizes.items()},
        digest_algorithm=DEFAULT_ALGORITHM,
        digest_block_bytes=1,  # no digest blocks: reads are never widened to them
        metadata={"imported_format": "safetensors"},
    )


__all__ = ["Rename", "as_manifest", "select", "target_keys"]
