"""Import a folder written by Accelerate's own ``save_state`` into a shardkeeper checkpoint.

Accelerate pickles optimizer, scheduler, RNG, sampler, scaler and registered-object state
(``*.bin``, ``*.pkl``, ``scaler.pt``); loading those runs code from the file, so the import
requires ``trust_pickle=True`` and warns. The folder is read by Accelerate's own loader into the
prepared objects, then written by shardkeeper like any ``save_state()``.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from shardkeeper.accelerate.plugin import plugin_of

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")


def import_accelerate_checkpoint(
    accelerator: Any, folder: str, *, trust_pickle: bool = False, step: int | None = None
) -> str:
    """Load ``folder`` (an Accelerate ``save_state`` output) and save it through shardkeeper.

    The objects must be prepared as for ``load_state``. ``step`` defaults to the ``<n>`` of a
    ``checkpoint_<n>`` folder, else the iteration counter. Returns the new step's path.
    """
    plugin = plugin_of(accelerator)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"shardkeeper import: {folder} is not a folder written by accelerator.save_state()")
    pickles = sorted(f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES))
    if pickles and not trust_pickle:
        raise ValueError(
            f"shardkeeper import of {folder}: {', '.join(pickles[:6])}{' ...' if len(pickles) > 6 else ''} "
            f"are pickles, and loading a pickle runs code from the file. If you trust this folder, "
            f"pass trust_pickle=True; shardkeeper checkpoints themselves never contain pickles"
        )
    if pickles:
        warnings.warn(
            f"shardkeeper import: unpickling {len(pickles)} file(s) of {folder} (trust_pickle=True); "
            f"this runs code from the files",
            stacklevel=2,
        )
    type(accelerator).load_state(accelerator, folder)  # Accelerate's own loader, not ours
    if step is None:
        m = re.search(r"checkpoint_(\d+)$", os.path.normpath(folder))
        if m:
            step = int(m.group(1))
            accelerator.project_configuration.iteration = step
    return plugin.save_state(step=step)
