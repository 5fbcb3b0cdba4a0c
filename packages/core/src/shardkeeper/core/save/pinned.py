"""Host buffers pinned at their exact size, and the CUDA devices a set of tensors lives on.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every request up to
the next power of two, so a staging buffer of 4 GiB and one page pins 8 GiB of host memory
for as long as the manager lives. ``pinned_host_buffer`` instead allocates ordinary memory
of the exact size and registers it with the CUDA driver (``cudaHostRegister``, as DCP's own
stager does); the registration is undone when the last view of the buffer is gone.

A failing CUDA runtime call leaves an error that the next kernel launch *on the same host
thread* reports as its own. Registering and unregistering therefore run on a short-lived
thread bound to the buffer's device: a refused registration (an old driver, a sandbox that
cannot pin user pages) never surfaces later in training; the buffer then falls back to
torch's allocator, and ``how`` says which one holds it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch

#: cudaHostRegisterPortable: pinned for every CUDA context, not only the current one.
_PORTABLE = 1


def cuda_devices(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The indices of the CUDA devices that hold any of ``tensors``, in first-seen order."""
    seen: dict[int, None] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.device.index if t.device.index is not None else torch.cuda.current_device(), None)
    return tuple(seen)


def _on_device_thread(device: int, fn: Callable[[], int]) -> int:
    """Run the CUDA runtime call ``fn`` on a fresh thread bound to ``device``; its error code
    (-1 if it raised), whose sticky error state dies with that thread."""
    out = [-1]

    def body() -> None:
        try:
            torch.cuda.set_device(device)
            out[0] = int(fn())
        except Exception:  # noqa: BLE001 - reported as a failed call, never raised
            out[0] = -1

    t = threading.Thread(target=body, name="shardkeeper-pin", daemon=True)
    t.start()
    t.join()
    return out[0]


def _unregister(ptr: int, device: int) -> None:
    _on_device_thread(device, lambda: torch.cuda.cudart().cudaHostUnregister(ptr))


def register(arr: np.ndarray, device: int) -> bool:
    """Pin the host memory of ``arr`` (uint8) for ``device``'s copies until ``arr`` is
    collected; False when the driver refuses (the memory stays as it is)."""
    ptr, nbytes = int(arr.ctypes.data), arr.nbytes
    err = _on_device_thread(device, lambda: torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if err != 0:
        return False
    done = weakref.finalize(arr, _unregister, ptr, device)  # an array's dealloc runs these before freeing
    done.atexit = False  # never after the CUDA context is gone
    return True


def pinned_host_buffer(nbytes: int, device: int) -> tuple[torch.Tensor, str]:
    """A pinned uint8 host tensor of exactly ``nbytes``, and how it is pinned: ``"registered"``
    (exact size, see the module doc) or ``"allocator"`` (torch's power-of-two allocator, when
    the driver refuses to register)."""
    arr = np.empty(nbytes, dtype=np.uint8)
    if register(arr, device):
        return torch.from_numpy(arr), "registered"
    del arr
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "allocator"


def host_buffer(nbytes: int, device: int | None) -> tuple[torch.Tensor, str | None]:
    """The staging buffer of a ``Stager``: pinned for ``device`` (``pinned_host_buffer``), or
    ordinary memory when the sources are on no CUDA device (``device`` None; how: None)."""
    if device is not None:
        return pinned_host_buffer(nbytes, device)
    return torch.empty(nbytes, dtype=torch.uint8), None


__all__ = ["cuda_devices", "host_buffer", "pinned_host_buffer", "register"]
