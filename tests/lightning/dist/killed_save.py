"""A Lightning run whose save of step 4 is held in its commit, killed there by the test.

    killed_save.py ROOT CKPTS

Trains ``Net`` (one device, CPU) with the plugin and ``ModelCheckpoint(every_n_train_steps=2,
save_last=True)``. The root's storage holds the put of step 4's manifest (a stuck disk or
object store: the save's data is written, its commit never lands), prints ``HELD`` and
waits; the test then kills the process with SIGKILL, the save of step 4 in flight.
"""

from __future__ import annotations

import sys
import threading

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.lightning.common import Net, cpu_trainer, loader

from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.lightning import ShardkeeperCheckpointIO

HELD_STEP = 4


def hold_the_commit_of(step: int) -> None:
    """Make the manifest put of ``step`` hang, as on a stuck storage."""
    put = LocalStorage.put_if_absent
    manifest = f"step-{step:012d}/manifest.json"

    def stuck(self: LocalStorage, path: str, data: bytes) -> None:
        if path.endswith(manifest):
            print("HELD", flush=True)
            threading.Event().wait()  # until the kill
        put(self, path, data)

    LocalStorage.put_if_absent = stuck  # type: ignore[method-assign]


def main() -> None:
    root, ckpts = sys.argv[1], sys.argv[2]
    hold_the_commit_of(HELD_STEP)
    L.seed_everything(3)
    mc = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_last=True)
    trainer = cpu_trainer(root + "-run", ShardkeeperCheckpointIO(root), callbacks=[mc])
    trainer.fit(Net(), loader())
    print("NOT HELD", flush=True)  # the test fails on this: the save of step 4 was never held


if __name__ == "__main__":
    main()
