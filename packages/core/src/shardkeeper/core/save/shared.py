"""Staging buffers in anonymous shared memory, for a save that a persist process writes.

A ``SharedBuffers`` is a ``Stager``'s allocator (``save/stage.py``): each buffer is a
``memfd`` (Linux), mapped in the trainer and, through its descriptor, in the persist process,
so the staging copy is the only copy the save makes. A memfd has no name: no file under
``/dev/shm`` is ever left behind, whoever exits first; its memory is freed when the last
mapping and descriptor are gone. On CUDA the mapping is registered as pinned memory
(``save/pinned.py``), so device-to-host copies land in it at full speed; where the driver
refuses, the buffer stays shared and unpinned (``how``: ``"shared"``).
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from shardkeeper.core.save.pinned import register


class SharedBuffers:
    """Allocates a ``Stager``'s buffers as memfds; ``current`` is the newest one's."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.nbytes = 0
        self.generation = 0
        """Counts the buffers allocated: a persist process maps each generation once."""

    def __call__(self, nbytes: int, device: int | None) -> tuple[torch.Tensor, str | None]:
        fd = os.memfd_create("shardkeeper-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        arr = np.frombuffer(mapped, dtype=np.uint8)  # keeps the mapping alive while a view does
        how = None
        if device is not None:
            how = "registered" if register(arr, device) else "shared"
        self.close()
        self.fd, self.nbytes = fd, nbytes
        self.generation += 1
        return torch.from_numpy(arr), how

    def close(self) -> None:
        """Drop this side's descriptor of the newest buffer (its mapping lives on in its views)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_shared(fd: int, nbytes: int) -> memoryview:
    """The persist process's view of a buffer it was sent (``fd`` is closed once mapped)."""
    try:
        return memoryview(mmap.mmap(fd, nbytes))
    finally:
        os.close(fd)


__all__ = ["SharedBuffers", "map_shared"]
