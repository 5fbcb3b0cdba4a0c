"""The last part of a restore on one rank, once every read succeeded: the objects and bytes
leaves are set, then the finalizers run (an object's ``load_state_dict`` with the state
dict the reads filled). A finalizer that raises is the user's object refusing its saved
state (a changed model, optimizer or scheduler), not damage: its error keeps its type and
gains the checkpoint, the step, the rank, the key and the remedy."""

from __future__ import annotations

from collections.abc import Sequence

from shardkeeper.core.errors import extended
from shardkeeper.core.restore.plan import RestorePlan
from shardkeeper.core.state.flatten import FlatState


def set_and_finalize(
    plan: RestorePlan, flat: FlatState, bytes_values: Sequence[bytes], wrote: set[str], where: str
) -> None:
    """Set the objects and bytes leaves, then run the finalizers of the prefixes something
    was restored under (``where``: the step's directory, source and rank, for messages)."""
    for key, fn in plan.deferred:
        wrote.add(key)
        fn()
    for (key, leaf, _), value in zip(plan.bytes_leaves, bytes_values):
        assert leaf.set is not None
        wrote.add(key)
        leaf.set(value)
    touched = prefixes(plan.restored)
    for prefix, fin in flat.finalizers:
        if prefix in touched:
            try:
                fin()
            except Exception as e:
                out = named(e, prefix, where)
                if out is e:
                    raise
                raise out from e


def prefixes(keys: Sequence[str]) -> set[str]:
    """Every ``/``-prefix of every key (``a/b/c`` -> ``a``, ``a/b``, ``a/b/c``): one set
    answers "was anything under this prefix restored" for every finalizer."""
    out: set[str] = set()
    for k in keys:
        parts = k.split("/")
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return out


def named(err: Exception, prefix: str, where: str) -> BaseException:
    """``err`` of ``prefix``'s ``load_state_dict``, its message led by where and what it was
    restoring and followed by the remedy (``errors.extended``: its type kept, as a caller may
    catch ``KeyError`` or ``RuntimeError`` as torch raises them)."""
    head = f"restoring {where}: the load_state_dict() of {prefix!r} refused the state it was given"
    tail = (
        f"the object no longer fits what was saved under {prefix!r} (a changed model, optimizer or scheduler?): "
        f"restore into an object built as it was at the save, leave {prefix!r} out of the state (or of only=), or "
        f"read the checkpoint with mgr.load() and adapt it"
    )
    return extended(err, tail, head=f"{head}: ")


__all__ = ["named", "prefixes", "set_and_finalize"]
