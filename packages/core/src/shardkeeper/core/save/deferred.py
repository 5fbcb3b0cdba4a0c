"""The deferred part of a staging copy (``staging="overlap"``, ``save/overlap.py``): made on
the caller's thread by ``Stager.stage_split``, run off it, checked for sources changed
meanwhile."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from shardkeeper.core.errors import TornStateError
from shardkeeper.core.save.pinned import cuda_devices
from shardkeeper.core.save.plan import WriteItem
from shardkeeper.core.state import _torch_compat as tc


class DeferredCopy:
    """The part of a staging copy that runs later, off the caller's thread.

    Made on the caller's thread, which records the version counters of each source and of the
    tensors it belongs to (and, on CUDA, an event on the current stream of each device the
    sources are on). ``run()`` copies every source into its place in the staging buffer, one
    call per device (on CUDA: on a side stream of that device, after its event; the
    background thread binds the device itself, since a new thread starts on device 0), and
    then checks that no source was changed in place meanwhile: a torch in-place op bumps a
    tensor's version counter, so a mutation that raced the copy is an error naming the keys,
    never a silently torn checkpoint. (Writes through ``.data``, numpy views or raw pointers
    do not bump it, nor do kernels that update their inputs internally, like BatchNorm's
    running statistics, which is why only optimizer-owned tensors are ever deferred; the rest
    is what ``wait_staged()`` is for.)
    """

    def __init__(self) -> None:
        self.items: list[WriteItem] = []
        self.srcs: list[torch.Tensor] = []
        self.dsts: list[torch.Tensor] = []
        self.watched: list[list[tuple[torch.Tensor, int]]] = []
        self.nbytes = 0
        self.copy_s = 0.0
        self._ready: dict[int, torch.cuda.Event] = {}  # by device: where its sources are final

    def add(self, item: WriteItem, src: torch.Tensor, dst: torch.Tensor, watch: Sequence[torch.Tensor] = ()) -> None:
        """Copy ``src`` (``item``'s bytes) into ``dst`` later; ``watch``: the tensors whose
        in-place changes before the copy ends make it torn."""
        self.items.append(item)
        self.srcs.append(src)
        self.dsts.append(dst)
        self.watched.append([(t, tc.version(t)) for t in (src, *watch)])
        self.nbytes += item.nbytes

    def mark_ready(self) -> None:
        """Caller's thread, once every item is added: on CUDA, where the sources are final."""
        for device in cuda_devices(self.srcs):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._ready[device] = event

    def run(self) -> None:
        """Copy (any thread); raise ``TornStateError`` if a source changed before it ended."""
        t0 = time.perf_counter()
        with torch.no_grad():
            if self._ready:
                for device, event in self._ready.items():
                    idx = [i for i, s in enumerate(self.srcs) if s.is_cuda and s.device.index == device]
                    with torch.cuda.device(device):
                        side = torch.cuda.Stream(device)
                        side.wait_event(event)
                        with torch.cuda.stream(side):
                            tc.copy_all([self.dsts[i] for i in idx], [self.srcs[i] for i in idx], non_blocking=True)
                        side.synchronize()
                rest = [i for i, s in enumerate(self.srcs) if not s.is_cuda]
                if rest:
                    tc.copy_all([self.dsts[i] for i in rest], [self.srcs[i] for i in rest])
            else:
                tc.copy_all(self.dsts, self.srcs)
        self.copy_s = time.perf_counter() - t0
        changed = [it.key for it, w in zip(self.items, self.watched) if any(tc.version(t) != v for t, v in w)]
        if changed:
            raise TornStateError(sorted(set(changed)))


__all__ = ["DeferredCopy"]
