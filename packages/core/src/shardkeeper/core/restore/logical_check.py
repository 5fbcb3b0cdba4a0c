"""The restore's check of what it assembled: every restored tensor against the logical digest
its save recorded (docs/format.md 6.1, docs/reliability.md "Logical digests").

Chunk digests prove that the bytes read are the bytes written; this proves that they landed
where they belong. Each rank sums, per tensor, the pieces it restored (``plan_check`` before
the reads; each tensor summed as its reads land, ``restore/sum_as_filled.py``, the rest after
them; all before objects are set and finalizers run). A rank that
holds a whole tensor (DDP, a replicated DTensor) judges it alone; one that holds none of it
takes no part. The pieces of a sharded tensor add up over the ranks that hold one copy of it (a DTensor's
``replica_index``, and on a submesh the mesh itself: FSDP2 over the data-parallel dimension
of a 2-D world has a copy per submesh): ``agree`` adds every rank's partials per (tensor,
copy) over the restore's own gloo group, in 16-bit limbs (an exact integer sum, whatever the
world size), so every rank judges the same totals, and every copy is checked, not only the
first. The check is one all-reduce of ``40 * tensors * copies`` bytes (none when every rank
held whole tensors; at most 32 MiB: beyond, each tensor's first copy alone).

A step committed with a ``replicas_disagree`` mark (its replicas disagreed at the save) is
restored with a warning that quotes it (``warn_marked``).

Not checked (counted in ``LogicalCheck.skipped``): tensors restored with a cast to another
dtype (``cast_dtypes=True``), per-rank leaves (their stored key depends on the ``per_rank``
policy), leaves whose save recorded no digest, and bytes leaves (set from verified chunks as
they are).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkeeper.core import metrics
from shardkeeper.core.errors import CorruptCheckpointError
from shardkeeper.core.format import logical
from shardkeeper.core.format.logical_member import MARK, digests_of, marked_kinds
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.table import TableLeaves
from shardkeeper.core.restore.share import peer_group
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.chunks import Piece, layout_of
from shardkeeper.core.state.flatten import FlatState, torch_dtype_name
from shardkeeper.core.state.fragment import Fragment
from shardkeeper.core.state.logical import piece_sums

log = logging.getLogger(__name__)

#: 16-bit limbs of a 64-bit sum: their sums over 2^47 ranks stay exact in an int64.
_LIMBS = 4
#: Per (tensor, replica): the limbs, then how many ranks added to it.
_WIDTH = _LIMBS + 1
#: The exchange's int64s at most (32 MiB): beyond, only each tensor's first copy is summed.
_MAX_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class _Task:
    """One restored tensor to sum: its index in ``keys``, recorded dtype and shape, its value
    in the target, the pieces this rank holds as planned (their memory tells which reads
    write into them), and its slot when they are part of a sharded tensor."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    value: torch.Tensor | Fragment
    pieces: tuple[Piece, ...]
    slot: tuple[int, int] | None  # (key index, copy): None for a whole tensor


@dataclass
class LogicalCheck:
    """One rank's part of a restore's logical check: ``keys``, the manifest's tensors with a
    digest (every rank's same order); ``problems``: whole tensors this rank found wrong;
    ``slots``: (key index, replica index) -> this rank's partial of a tensor it holds part
    of; ``checked``: tensors checked here or through ``slots``; ``skipped``: restored
    tensors this check cannot judge. ``plan_check`` makes it; ``sum`` each of ``tasks``
    once its reads have landed (from any thread), ``sum_rest`` the ones not summed yet."""

    keys: list[str] = field(repr=False)
    digests: list[str] = field(repr=False)
    manifest: Manifest = field(repr=False)
    problems: list[str] = field(default_factory=list)
    slots: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)
    checked: int = 0
    skipped: list[str] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    tasks: dict[str, _Task] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __repr__(self) -> str:  # counts and the step checked: a log line, never the manifest or keys
        return (
            f"LogicalCheck(step={self.manifest.step}, checked={self.checked}, problems={len(self.problems)}, "
            f"skipped={len(self.skipped)}, rank={self.rank})"
        )

    def sum(self, key: str) -> None:
        """Sum ``key``'s pieces as they are now (the reads into them done) and record the
        result; a key summed before, or not to be checked, is left alone."""
        with self._lock:
            task = self.tasks.pop(key, None)
        if task is None:
            return
        # The pieces found again, now: a layout whose local view is a copy (not the target's
        # memory) copies what the reads left. Outside the lock: sums run in parallel.
        pieces = layout_of(task.value, self.world_size, self.rank).pieces
        total = piece_sums(task.dtype, task.shape, pieces)
        with self._lock:
            self.checked += 1
            if task.slot is not None:
                self.slots[task.slot] = (self.slots.get(task.slot, 0) + total) & logical.MASK
                return
            got, want = logical.finalize(task.dtype, task.shape, total), self.digests[task.index]
            if got != want:
                self.problems.append(_wrong(key, got, want, f"restored on rank {self.rank}"))

    def sum_rest(self) -> None:
        """Sum every task not summed yet (after the reads: those no read's end summed)."""
        for key in list(self.tasks):
            self.sum(key)


def _wrong(key: str, got: str, want: str, whose: str) -> str:
    return f"tensor {key!r} as {whose} has logical digest {got}, the save recorded {want}"


def plan_check(
    flat: FlatState, manifest: Manifest, restored: Sequence[str], *, rank: int, world_size: int
) -> LogicalCheck | None:
    """What this rank will sum of the tensors it restores (``restored``: target keys), one
    task per tensor; None when the manifest records no digests. Planned before the reads,
    summed as they land (``restore/sum_as_filled.py``) or after them."""
    recorded = digests_of(manifest.logical, manifest.leaves)
    if not recorded:
        return None
    keys = [k for k, d in recorded.items() if d is not None]
    index = {k: i for i, k in enumerate(keys)}
    check = LogicalCheck(keys, [str(recorded[k]) for k in keys], manifest, rank=rank, world_size=world_size)
    for key in restored:
        leaf = flat.leaves.get(key)
        i = index.get(key)
        if leaf is None or leaf.kind != "tensor" or leaf.per_rank is not None or i is None:
            if leaf is not None and leaf.kind == "tensor":
                check.skipped.append(key)
            continue
        value = leaf.value
        if not isinstance(value, (torch.Tensor, Fragment)):
            check.skipped.append(key)
            continue
        layout = layout_of(value, world_size, rank)
        dtype, shape = _head(manifest, key)
        if torch_dtype_name(layout.dtype) != dtype or tuple(layout.global_shape) != shape:
            check.skipped.append(key)  # a cast (cast_dtypes=True) or a reshaped target
            continue
        held, numel = sum(p.numel for p in layout.pieces), math.prod(shape, start=1)
        if not held and numel:
            continue  # (none of it here: the ranks that hold it judge it)
        slot = None if held == numel else (i, layout.replica_index + layout.replicas * _mesh_first_rank(value))
        check.tasks[key] = _Task(i, dtype, shape, value, tuple(layout.pieces), slot)
    return check


def _mesh_first_rank(value: Any) -> int:
    """The lowest rank of a DTensor's mesh, 0 for other tensors: a DTensor on a submesh (FSDP2
    over the data-parallel dimension of a 2-D world) has copies on the other submeshes, which
    the mesh does not name; each copy adds up on its own."""
    return int(value.device_mesh.mesh.min()) if tc.is_dtensor(value) else 0


def _head(manifest: Manifest, key: str) -> tuple[str, tuple[int, ...]]:
    """A leaf's recorded dtype and shape, without materializing a table's chunk records."""
    leaves = manifest.leaves
    rec = leaves.head(key) if isinstance(leaves, TableLeaves) else leaves[key]
    return str(rec.dtype), tuple(int(n) for n in rec.shape)


def agree(check: LogicalCheck | None, group: Any, where: str) -> tuple[list[str], bool]:
    """Collective over ``group`` (the restore's ``PeerGroup``; every rank calls it with its
    ``plan_check``, every task summed; None where the manifest has no digests): the problems every rank found,
    the same list on every rank, and whether some other rank found whole tensors wrong (named
    in its own error)."""
    mine = check.problems if check is not None else []
    slots = check.slots if check is not None else {}
    head = torch.tensor([1 + max((r for _, r in slots), default=-1), int(bool(mine))], dtype=torch.int64)
    group.all_reduce_max(head, f"{where}: the logical check's sizes")
    replicas, any_wrong = int(head[0]), bool(head[1])
    problems = list(mine)
    if check is not None and len(check.keys) * replicas * _WIDTH > _MAX_ELEMENTS:
        replicas = 1  # (a sparse layout's copies: the first alone is summed, bounding the exchange)
        slots = {s: v for s, v in slots.items() if s[1] == 0}
    if replicas and check is not None:
        n = len(check.keys)
        t = torch.zeros((n, replicas, _WIDTH), dtype=torch.int64)
        for (i, r), total in slots.items():  # (r: the copy's slot, below ``replicas``)
            for j in range(_LIMBS):
                t[i, r, j] = (total >> (16 * j)) & 0xFFFF
            t[i, r, _LIMBS] = 1
        group.all_reduce_sum(t, f"{where}: the logical check's sums")
        rows = t.tolist()
        for i, per in enumerate(rows):
            for r, limbs in enumerate(per):
                if not limbs[_LIMBS]:
                    continue
                total = sum(int(v) << (16 * j) for j, v in enumerate(limbs[:_LIMBS])) & logical.MASK
                dtype, shape = _head(check.manifest, check.keys[i])
                got = logical.finalize(dtype, shape, total)
                if got != check.digests[i]:
                    whose = f"assembled by the {limbs[_LIMBS]} rank(s) holding copy {r} of it"
                    problems.append(_wrong(check.keys[i], got, check.digests[i], whose))
    return problems, any_wrong and not mine


def judge(ctx: Any, check: LogicalCheck | None, step: int, *, collective: bool = True) -> BaseException | None:
    """The restore's verdict on what it assembled of ``step`` (``ctx``: the manager's
    ``ManagerContext``; ``collective`` in a group: every rank calls it, after the ranks agreed
    that every attempt read its bytes): None, or the error that makes the step damaged on
    every rank (``logical_check="error"``). ``"warn"``: a warning and a metric, and None."""
    url = ctx.storage.url
    where = f"restore of step {step} under {url}" if collective else f"load() of step {step} under {url}"
    if collective and ctx.world_size > 1:
        problems, elsewhere = agree(check, peer_group(ctx.coord, ctx.settings.commit_timeout_s), where)
    else:
        problems, elsewhere = (check.problems if check is not None else []), False
    if not problems and not elsewhere:
        return None
    metrics.record(metrics.LOGICAL_MISMATCHES, len(problems), rank=ctx.rank, step=step)
    cause = (
        "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        if problems
        else "another rank found a restored tensor that does not match its recorded logical digest (see its error)"
    )
    text = (
        f"{where} (rank {ctx.rank}): what was assembled is not what was saved: {cause}. Every chunk read "
        f"passed its digest, so either the recorded digest is not the saved tensor's (a writer bug, an "
        f"edited manifest: `shardkeeper verify {url} {step} --logical` finds it), or bytes landed in the "
        f"wrong place (a restore into a layout this version places wrongly, a target the framework changed "
        f"while it was filled)"
    )
    if ctx.settings.logical_check == "warn":
        log.warning("%s; logical_check='warn': the restore goes on with these values", text)
        return None
    err = CorruptCheckpointError(
        f"{text}; the step counts as damaged. Report it with `shardkeeper inspect {url} {step} --json`; "
        f"logical_check='warn' restores it anyway"
    )
    err.logical_mismatch = True  # type: ignore[attr-defined]  # (quarantined if verify --logical proves it)
    return err


def warn_marked(ctx: Any, manifest: Manifest, where: str) -> str | None:
    """The restored step's ``replicas_disagree`` mark (docs/format.md 6.1), logged as a warning
    (``where``: the restore, e.g. "restore of step 3 under ROOT"), or None without one. Its
    save committed although copies of replicated tensors disagreed (``logical_check="warn"``);
    what was restored is each one's written copy. Warned whatever ``logical_check`` is: the
    mark is the save's finding, not this restore's check."""
    member = manifest.logical
    mark = member.get(MARK) if isinstance(member, dict) else None
    if not isinstance(mark, str) or not mark:
        return None
    url, step = ctx.storage.url, manifest.step
    log.warning(
        "%s (rank %d): step %d was committed with logical_check='warn' although copies of replicated %s "
        "disagreed at its save: %s. The values restored are each one's written copy (that of the ranks the "
        "mark says wrote it), not the other copies, which were not saved: the ranks did not hold the same state "
        "at that step. `shardkeeper verify %s %d` reports the mark; if the divergence matters, restore an "
        "earlier step (restore(state, step=N))",
        where,
        ctx.rank,
        step,
        marked_kinds(mark),
        mark[:2000],
        url,
        step,
    )
    return mark


__all__ = ["LogicalCheck", "agree", "judge", "plan_check", "warn_marked"]
