"""Replica agreement at save: the copies of a replicated tensor that are not written are
compared with the one that is, through their logical sums (docs/reliability.md, "Replicas
that disagree").

A replicated tensor (a plain tensor under DDP, a DTensor with ``Replicate`` mesh dimensions:
HSDP, TP-replicated norms) is written by one copy. Every rank that holds a copy it does not
write sums its pieces in ``save()`` (``ReplicaSums``: on two threads beside the staging copy,
awaited before ``save()`` returns, while the tensors are the step's; on the device for CUDA
tensors) and reports them with its chunks.
The coordinator adds the sums of each copy's ranks and compares each copy with the written
one (``format/logical_member.py``, ``combine_reports``); a copy that differs is marked in the
manifest's ``logical`` member (``replicas_disagree``), and ``judge`` then refuses the save
(``logical_check="error"``) or lets it commit with a warning (``"warn"``).

Compared: plain tensors, DTensors whose mesh is the whole world, and DTensors on a submesh
of a named mesh over the whole world (FSDP2 over the data-parallel dimension of a 2-D world:
the copies along the dimensions the submesh leaves out, numbered by ``state/copies.py`` as
the whole mesh's ``Replicate`` dimensions; one of them writes). Not compared: a DTensor on
another mesh (a flattened dimension's, a subgroup's: its copies are not known), the buffers of an
``nn.Module`` in the state (BatchNorm's running statistics: under DDP each rank's forward
updates its own copy, which DDP overwrites with rank 0's at the next forward), and, where a
state dict holds them as plain tensors, keys ending in a normalization layer's statistics
(``NORM_STATISTICS``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from shardkeeper.core import metrics
from shardkeeper.core.errors import StateMismatchError
from shardkeeper.core.format.logical_member import REPLICAS, disagreements_in, encode_sums, marked_kinds
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.save.plan import SavePlan
from shardkeeper.core.state.chunks import Piece, layout_of
from shardkeeper.core.state.copies import copy_of
from shardkeeper.core.state.flatten import FlatState, as_torch
from shardkeeper.core.state.logical import piece_sums

log = logging.getLogger(__name__)

#: The buffers torch's normalization layers keep per rank (BatchNorm, InstanceNorm with running
#: statistics): not compared where a state dict holds them as plain tensors (no module known).
NORM_STATISTICS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


#: Threads that sum the copies a rank does not write, beside the caller's staging copy.
SUM_THREADS = 2


class ReplicaSums:
    """The sums of the replicated copies this rank holds and does not write, running on
    ``SUM_THREADS`` threads beside ``save()``'s staging copy (numpy's products and torch's
    device sums release the interpreter lock), split by bytes; ``member()`` waits for them.
    Started and awaited within ``save()``: the tensors may change once it returns."""

    def __init__(self, flat: FlatState, plan: SavePlan, rank: int, world_size: int) -> None:
        self._parts: list[tuple[str, int, str, tuple[int, ...], list[Piece]]] = []
        for key in plan.replica_keys:
            leaf = flat.leaves.get(key)
            if leaf is None or key in flat.buffers or key.rsplit("/", 1)[-1].rsplit(".", 1)[-1] in NORM_STATISTICS:
                continue  # (a module's buffers may differ by design)
            if leaf.kind == "bytes":
                t = torch.frombuffer(bytearray(leaf.value), dtype=torch.uint8) if leaf.value else torch.empty(0)
            else:
                t = as_torch(leaf.value)
            layout = layout_of(t, world_size, rank)
            copy = copy_of(t, layout, world_size)
            if copy is None:
                continue  # (a DTensor whose copies the saving world does not name)
            _, dtype, shape = plan.declared[key]
            self._parts.append((key, copy.index, dtype, tuple(shape), layout.pieces))
        self._sums = [0] * len(self._parts)
        self._errors: list[BaseException] = []
        shares: list[list[int]] = [[] for _ in range(SUM_THREADS)]
        load = [0] * SUM_THREADS
        for i in sorted(range(len(self._parts)), key=lambda i: -_nbytes(self._parts[i][4])):
            j = load.index(min(load))  # (the largest first, each to the least loaded thread)
            shares[j].append(i)
            load[j] += _nbytes(self._parts[i][4])
        self._threads = [
            threading.Thread(target=self._sum, args=(share,), name="shardkeeper-replica-sums", daemon=True)
            for share in shares
            if share
        ]
        for th in self._threads:
            th.start()

    def _sum(self, share: list[int]) -> None:
        try:
            for i in share:
                _, _, dtype, shape, pieces = self._parts[i]
                self._sums[i] = piece_sums(dtype, shape, pieces)
        except BaseException as e:  # raised by member(), on the caller's thread
            self._errors.append(e)

    def member(self) -> dict[str, Any] | None:
        """The ``replicas`` member of this rank's chunk report: per replicated key it holds
        and does not write, its copy's number and the sum mod 2^64 of its pieces (None: none)."""
        for th in self._threads:
            th.join()
        if self._errors:
            raise self._errors[0]
        if not self._parts:
            return None
        order = sorted(range(len(self._parts)), key=lambda i: self._parts[i][0])
        return {
            "keys": [self._parts[i][0] for i in order],
            "copies": [self._parts[i][1] for i in order],
            "sums": encode_sums(self._sums[i] for i in order),
        }


def _nbytes(pieces: list[Piece]) -> int:
    return sum(p.local.numel() * p.local.element_size() for p in pieces)


def with_replicas(chunks: dict[str, Any], member: dict[str, Any] | None) -> dict[str, Any]:
    """A rank's chunk report with its ``replicas`` member; as it was without one."""
    return chunks if not member else {**chunks, REPLICAS: member}


#: What a refusal or warning says of the disagreeing copies of tensors, and of bytes leaves.
_TENSORS = (
    "A plain tensor in the state is taken as replicated (DDP): if it is per-rank state (a counter, an RNG "
    "state, a rank's own statistics), wrap it in PerRank(...) (RNGState() for RNG states); if it is a "
    "parameter or optimizer state, a replica diverged (silent data corruption on a device, a "
    "nondeterministic kernel, a framework bug) and the ranks do not train the same model"
)
_BYTES = (
    "A bytes leaf is taken as replicated too, saved once for every rank, but these bytes differ between "
    "ranks: if they are per-rank data, save them under a per-rank key (PerRank(...)); else make them "
    "identical on every rank"
)


def judge(manifest: Manifest, mode: str, rank: int) -> None:
    """The coordinator's verdict on a merged manifest whose replicas disagree: raise (the
    save fails on every rank, the previous step stays the newest) for ``"error"``; warn and
    count for ``"warn"`` (the manifest keeps the mark, which ``verify`` reports)."""
    member = manifest.logical or {}
    said = member.get("replicas_disagree") if isinstance(member, dict) else None
    if not said:
        return
    metrics.record(metrics.LOGICAL_MISMATCHES, disagreements_in(str(said)), rank=rank, step=manifest.step)
    kinds = marked_kinds(str(said))
    advice = [_TENSORS] if "tensors" in kinds else []
    advice += [_BYTES] if "bytes" in kinds else []
    text = f"step {manifest.step}: copies of replicated {kinds} disagree: {str(said)[:2000]}. {'. '.join(advice)}"
    if mode == "warn":
        log.warning("%s; logical_check='warn': committed with the mark, which `shardkeeper verify` reports", text)
        return
    raise StateMismatchError(
        f"{text}; the save is refused and the previous step stays the newest. logical_check='warn' "
        f"commits such a step with a mark"
    )


__all__ = ["SUM_THREADS", "ReplicaSums", "judge", "with_replicas"]
