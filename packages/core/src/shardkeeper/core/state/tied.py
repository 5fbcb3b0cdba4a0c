"""Tied weights on restore: a target key the checkpoint lacks is no missing key when the
module holds that tensor under another name the checkpoint has.

A module's ``state_dict()`` lists a tied weight under every name it has (GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``), while a save that walks
``named_parameters()`` (DeepSpeed's engine state, for one) holds it under one name. Restoring
the twin fills the alias too, since they are one tensor; so a strict restore of such a
checkpoint into the module must not fail on the alias. The groups come from the module
(``state.module_ties``), never from where a tensor's memory lies: every rank decides alike,
a DTensor's empty shard included.

The other way round, a checkpoint may hold two of a group's names as two tensors (a model
saved untied, restored into one that ties them). Both would be copied into the one tensor, the
last copy winning: ``check_ties`` refuses that before a byte is read, unless the two saved
tensors are the same bytes (a tied model's save lists its weight under each name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shardkeeper.core.codec.incremental import content_id
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.records import ChunkRecord


def object_ties(leaves: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The groups of tensor leaf keys that hold one tensor object (a target that lists a tensor
    under two keys, as a plain dict may): restoring two saved values into it would keep the
    last one. The same object under the same keys on every rank, so every rank decides alike."""
    by_object: dict[int, list[str]] = {}
    for key, leaf in leaves.items():
        if leaf.kind == "tensor":
            by_object.setdefault(id(leaf.value), []).append(key)
    return [tuple(keys) for keys in by_object.values() if len(keys) > 1]


def merge_ties(groups: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``groups`` with the ones that share a key joined, each in first-seen order."""
    merged: list[list[str]] = []
    where: dict[str, int] = {}
    for group in groups:
        hits = sorted({where[k] for k in group if k in where})
        if not hits:
            target = len(merged)
            merged.append([])
        else:
            target = hits[0]
            for other in hits[1:]:  # a group bridging two earlier ones joins them
                for k in merged[other]:
                    where[k] = target
                merged[target].extend(merged[other])
                merged[other] = []
        for k in group:
            if where.get(k) != target:
                where[k] = target
                merged[target].append(k)
    return [tuple(dict.fromkeys(g)) for g in merged if len(set(g)) > 1]


def tied_aliases(ties: Sequence[tuple[str, ...]], missing: Iterable[str], restored: Iterable[str]) -> dict[str, str]:
    """Each of ``missing`` that is tied to a restored key, mapped to that key."""
    done = set(restored)
    out: dict[str, str] = {}
    for group in ties:
        twin = next((k for k in group if k in done), None)
        if twin is None:
            continue
        for key in group:
            if key not in done:
                out[key] = twin
    return {k: out[k] for k in missing if k in out}


def check_ties(
    ties: Sequence[tuple[str, ...]],
    restored: Iterable[str],
    chunks_of: Callable[[str], Sequence[ChunkRecord]],
    algorithm: str,
    where: str,
) -> None:
    """Raise ``StateMismatchError`` when the checkpoint holds two names of one tie group with
    different contents (``chunks_of(key)``: all the saved chunks of ``key``; their boxes and
    content ids are compared, no byte is read)."""
    done = set(restored)
    clashes: list[str] = []
    for group in ties:
        saved = [k for k in group if k in done]
        if len(saved) < 2:
            continue
        first = _fingerprint(chunks_of(saved[0]), algorithm)
        differ = [k for k in saved[1:] if _fingerprint(chunks_of(k), algorithm) != first]
        if differ:
            names = [repr(k) for k in (saved[0], *differ)]
            clashes.append(f"{', '.join(names[:-1])} and {names[-1]}")
    if clashes:
        raise StateMismatchError(
            f"the target state ties weights that {where} holds as different tensors: {'; '.join(clashes)} "
            f"are one tensor in the target (tied weights, or one tensor listed under several keys) but were saved "
            f"with different values (a model saved untied); nothing was read. Build the model as it was saved (untied, e.g. "
            f"tie_word_embeddings=False), or restore one name of each group by leaving the others out "
            f"with only=[...]"
        )


def _fingerprint(chunks: Sequence[ChunkRecord], algorithm: str) -> list[tuple[object, ...]]:
    """Each chunk's box and content id (of its raw bytes; an encoded chunk's ``content``)."""
    out = []
    for c in chunks:
        if c.encoding == "raw":
            content = content_id(c.digests, algorithm)
        else:
            content = c.content or f"{c.encoding}:{','.join(c.digests)}"
        out.append((tuple(c.offsets), tuple(c.shape), content))
    return sorted(out)


__all__ = ["check_ties", "merge_ties", "object_ties", "tied_aliases"]
