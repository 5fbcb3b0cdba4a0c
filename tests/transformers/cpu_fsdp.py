"""Accelerate's FSDP plugin on CPU, for tests: Accelerate sets ``DistributedType.FSDP`` only when
its process state is a GPU-like type (``AcceleratorState.__init__``), so a gloo launch on CPU
(``MULTI_CPU``) never gets it, though FSDP1 and FSDP2 themselves run on CPU with gloo.

``allow()`` lets ``AcceleratorState`` see ``MULTI_GPU`` while it decides, and gives the
process state back its own ``MULTI_CPU`` right after: the device (CPU), the backend (gloo) and
every later step are Accelerate's and the Trainer's own, unchanged. The gate is the one thing
a CPU machine cannot reach; a GPU run needs none of this.
"""

from __future__ import annotations

from typing import Any


def allow() -> None:
    """Let the next ``AcceleratorState`` of this process take the FSDP plugin on CPU."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    own = state.AcceleratorState.__init__
    if getattr(own, "_cpu_fsdp", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        shared = state.PartialState._shared_state
        was = shared.get("distributed_type")
        if was == DistributedType.MULTI_CPU:
            shared["distributed_type"] = DistributedType.MULTI_GPU
        try:
            own(self, *args, **kwargs)
        finally:
            if was == DistributedType.MULTI_CPU:
                shared["distributed_type"] = was

    init._cpu_fsdp = True  # type: ignore[attr-defined]
    state.AcceleratorState.__init__ = init  # type: ignore[method-assign]
