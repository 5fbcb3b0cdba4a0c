"""Overlapped staging: a save's copy runs during the next forward/backward, not in ``save()``.

Parameters and optimizer state change only in ``optimizer.step()``. So, with
``staging="overlap"``, the copy of exactly those tensors is deferred to the background, and
the next ``optimizer.step()`` of each optimizer found in the saved state waits for it through
torch's ``Optimizer.register_step_pre_hook``. Gradient accumulation steps (no
``optimizer.step()``) never wait. Every other tensor of the state (module buffers such as
BatchNorm running statistics, which forward mutates; scheduler, RNG and user tensors) is
copied before ``save()`` returns, as in blocking staging.

Where optimizers come from: ``torch.optim.Optimizer`` objects anywhere in the saved state
(their innermost ``.optimizer`` when wrapped, as Accelerate and Lightning wrap them), and
``OptimizerHolder`` objects (an adapter's state object holding a framework's inner optimizer,
e.g. a DeepSpeed engine's). A deferred tensor is one whose
storage is a parameter (a DTensor's local shard) or a state tensor of such an optimizer.

Why the hook stays registered: torch iterates its hook dict while calling the hooks, so
removing a hook from inside itself, or from the background thread while a step runs,
raises "OrderedDict mutated during iteration". The hook is therefore installed once per
optimizer and manager (a single attribute check while nothing is staging), and removed on
the caller's thread: at ``close()``, or at a ``save()`` whose state no longer holds it.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, cast

import torch

from shardkeeper.core.save.deferred import DeferredCopy
from shardkeeper.core.state import _torch_compat as tc
from shardkeeper.core.state.flatten import PerRank

STAGING_MODES = ("blocking", "overlap")

#: Test seam: called on the background thread right before a deferred copy (None in use).
_before_copy: Any = None


class OptimizerHolder(Protocol):
    """An object of the saved state that holds optimizers the state does not show (an
    adapter's state object around a framework's inner optimizer): with ``staging="overlap"``,
    their ``step()`` waits for the copy of the tensors it mutates. Recognised by the method
    alone (an attribute lookup per value of the state, not a protocol ``isinstance``)."""

    def shardkeeper_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose ``step()`` mutates tensors this object saves."""
        ...


def _innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    seen = {id(opt)}
    inner = getattr(opt, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and id(inner) not in seen:
        opt = inner
        seen.add(id(opt))
        inner = getattr(opt, "optimizer", None)
    return opt


def find_optimizers(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers whose ``step()`` mutates tensors of ``state`` (see the module doc)."""
    found: dict[int, torch.optim.Optimizer] = {}
    stack: list[Any] = [state]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, torch.optim.Optimizer):
            inner = _innermost(v)
            found[id(inner)] = inner
        elif callable(getattr(v, "shardkeeper_optimizers", None)):
            for o in cast(OptimizerHolder, v).shardkeeper_optimizers():
                if isinstance(o, torch.optim.Optimizer):
                    inner = _innermost(o)
                    found[id(inner)] = inner
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, PerRank):
            stack.append(v.value)
    return list(found.values())


def _storage_key(t: Any) -> int:
    if tc.is_dtensor(t):
        t = tc.local_tensor(t)
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class OptimizerTensors:
    """Where the parameters and state tensors of some optimizers live in memory.

    ``owners(src)`` answers, for a tensor a save is about to copy: the optimizer tensors whose
    bytes it overlaps (None: it belongs to no optimizer). Those are what in-place changes go
    through (``p.add_`` on a DTensor bumps the DTensor's version counter, not its local
    tensor's), so the deferred copy watches their version counters.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        spans: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for opt in optimizers:
            tensors: list[Any] = [p for g in opt.param_groups for p in g["params"]]
            for st in opt.state.values():
                if isinstance(st, Mapping):
                    tensors.extend(st.values())
            for t in tensors:
                key = _storage_key(t)
                if not key:
                    continue
                local = tc.local_tensor(t) if tc.is_dtensor(t) else t
                start = local.data_ptr()
                if local.numel():
                    spans.setdefault(key, []).append((start, start + local.numel() * local.element_size(), t))
        self._by_storage = {k: sorted(v, key=lambda s: s[0]) for k, v in spans.items()}
        self._starts = {k: [s[0] for s in v] for k, v in self._by_storage.items()}
        self._longest = {k: max(s[1] - s[0] for s in v) for k, v in self._by_storage.items()}

    def __bool__(self) -> bool:
        return bool(self._by_storage)

    def owners(self, src: torch.Tensor) -> list[torch.Tensor] | None:
        key = _storage_key(src)
        spans = self._by_storage.get(key)
        if not spans or not src.numel():
            return None
        a = src.data_ptr()
        b = a + src.numel() * src.element_size()  # a chunk is contiguous within its span
        i = bisect.bisect_left(self._starts[key], b)  # spans[:i] start before the chunk ends
        lowest = a - self._longest[key]  # a span starting at or before this ends before a
        out = []
        while i > 0:
            i -= 1
            start, end, t = spans[i]
            if start <= lowest:
                break
            if end > a:
                out.append(t)
        return out or None


class StagingGate:
    """One manager's pending deferred copy, and the step pre-hooks that wait for it."""

    def __init__(self) -> None:
        self._pending: DeferredCopy | None = None
        self._done: threading.Event | None = None
        self._hooks: dict[int, tuple[weakref.ref[torch.optim.Optimizer], Any]] = {}
        self.waits = 0
        """How many times an optimizer step (or ``wait()``) waited for a deferred copy."""

    def install(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Caller's thread: hook every optimizer in ``optimizers``; unhook the others."""
        wanted = {id(o): o for o in optimizers}
        for key in list(self._hooks):
            ref, handle = self._hooks[key]
            if key not in wanted or ref() is not wanted[key]:
                handle.remove()
                del self._hooks[key]
        me = weakref.ref(self)

        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            gate = me()
            if gate is not None and gate._done is not None:
                gate.wait()

        for key, opt in wanted.items():
            if key not in self._hooks:
                self._hooks[key] = (weakref.ref(opt), opt.register_step_pre_hook(hook))

    def begin(self, deferred: DeferredCopy) -> threading.Event:
        """Caller's thread: ``deferred`` is now what mutators must wait for."""
        if self._done is not None:  # the previous save ended (the manager waited for it)
            self._done.wait()
        deferred.mark_ready()
        self._pending = deferred
        self._done = threading.Event()
        return self._done

    def run(self, deferred: DeferredCopy, done: threading.Event) -> None:
        """Background thread: the copy; ``done`` is set whatever happens (hooks never hang)."""
        try:
            if _before_copy is not None:
                _before_copy()
            deferred.run()
        finally:
            done.set()

    def wait(self) -> None:
        """Block until the pending deferred copy has ended (failed or not)."""
        done = self._done
        if done is None:
            return
        done.wait()
        self.waits += 1
        if self._done is done:
            self._done = None
            self._pending = None

    def staged(self) -> bool:
        return self._done is None or self._done.is_set()

    def close(self) -> None:
        """Caller's thread: wait, then remove every hook."""
        self.wait()
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    @property
    def hooked(self) -> int:
        return len(self._hooks)


__all__ = ["OptimizerHolder", "OptimizerTensors", "STAGING_MODES", "StagingGate", "find_optimizers"]
