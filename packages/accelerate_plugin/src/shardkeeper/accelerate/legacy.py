"""Import a folder written by Accelerate's own ``save_state`` into a shardkeeper checkpoint.

Accelerate pickles optimizer, scheduler, RNG, sampler, scaler and registered-object state
(``*.bin``, ``*.pkl``, ``scaler.pt``), and its FSDP and DeepSpeed loaders unpickle the files of
subfolders (a DCP ``.metadata``, DeepSpeed's ``*.pt``); loading those runs code from the file.
So a folder holding any file, at any depth, that is not known-safe (``legacy.is_known_safe``:
``*.safetensors``, ``*.json``, ``*.txt``, ``latest``) imports only with ``trust_pickle=True``,
the bool (the core's ``require_trust``, before Accelerate's loader runs), and warns even then.
The folder is read by Accelerate's own loader into the prepared objects, then written by
shardkeeper like any ``save_state()``.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from shardkeeper.accelerate.plugin import plugin_of
from shardkeeper.core.adapter import possible_pickles, require_trust


def import_accelerate_checkpoint(
    accelerator: Any, folder: str, *, trust_pickle: bool = False, step: int | None = None
) -> str:
    """Load ``folder`` (an Accelerate ``save_state`` output) and save it through shardkeeper.

    The objects must be prepared as for ``load_state``. ``step`` defaults to the ``<n>`` of a
    ``checkpoint_<n>`` folder, else the iteration counter. Returns the new step's path.
    ``PermissionError`` if the folder holds a file that may be unpickled and ``trust_pickle``
    is not True.
    """
    plugin = plugin_of(accelerator)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"shardkeeper import: {folder} is not a folder written by accelerator.save_state()")
    pickles = possible_pickles(folder)
    if pickles:
        require_trust(
            folder,
            trust_pickle=trust_pickle,
            why=(
                f"it holds files that Accelerate's loader may unpickle ({', '.join(pickles[:6])}"
                f"{' ...' if len(pickles) > 6 else ''}); shardkeeper checkpoints themselves never contain pickles"
            ),
        )
        warnings.warn(
            f"shardkeeper import: unpickling what Accelerate's loader reads of {folder} ({len(pickles)} "
            f"file(s) that may be pickles; trust_pickle=True): this can run code from the files",
            stacklevel=2,
        )
    type(accelerator).load_state(accelerator, folder)  # Accelerate's own loader, not ours
    if step is None:
        m = re.search(r"checkpoint_(\d+)$", os.path.normpath(folder))
        if m:
            step = int(m.group(1))
            accelerator.project_configuration.iteration = step
    return plugin.save_state(step=step)


__all__ = ["import_accelerate_checkpoint"]
