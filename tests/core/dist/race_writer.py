"""One of two writers that race to commit the same step on every backend (a restarted job and
a zombie of the previous one); tests/core/commit/test_fenced_race.py starts two of these at once.

    race_writer.py NAME SEED BARRIER_DIR OUT_JSON SPEC_JSON

SPEC_JSON is a list of ``{"name", "url", "options"}`` roots. For each root this process saves
step 7 (a state that is a function of SEED) synchronously. Right before its manifest's
put-if-absent it waits until the other writer got there too, so both conditional writes reach
the server together. OUT_JSON gets, per root, the outcome (``committed`` or ``conflict`` with
the error text) and the data files this writer wrote.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shardkeeper.core import CheckpointManager, CommitConflictError
from shardkeeper.core.storage import open_storage
from shardkeeper.core.storage.base import Storage, Writer
from shardkeeper.core.storage.wrapper import StorageWrapper

STEP = 7
BARRIER_TIMEOUT_S = 60.0


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 128, generator=g), "b": torch.randn(1000, generator=g), "meta": {"seed": seed}}


class RacingStorage(StorageWrapper):
    """Records the files opened for writing; holds the manifest's put-if-absent at a barrier."""

    def __init__(self, inner: Storage, barrier: Path, name: str) -> None:
        super().__init__(inner)
        self.barrier, self.name = barrier, name
        self.written: list[str] = []

    def open_writer(self, path: str) -> Writer:
        self.written.append(path)
        return self.inner.open_writer(path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        if path.endswith("manifest.json"):
            self.barrier.mkdir(parents=True, exist_ok=True)
            (self.barrier / self.name).touch()
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while len(list(self.barrier.iterdir())) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the other writer never reached the commit ({self.barrier})")
                time.sleep(0.001)
        self.inner.put_if_absent(path, data)


def main(name: str, seed: int, barrier_dir: Path, out: Path, spec: list[dict[str, Any]]) -> None:
    results = {}
    for root in spec:
        storage = RacingStorage(open_storage(root["url"], **root["options"]), barrier_dir / root["name"], name)
        try:
            with CheckpointManager(storage, retry_base_delay_s=0.01) as mgr:  # type: ignore[arg-type]
                mgr.save(STEP, state(seed), async_save=False).wait()
            outcome, error = "committed", ""
        except CommitConflictError as e:
            outcome, error = "conflict", str(e)
        results[root["name"]] = {"outcome": outcome, "error": error, "written": storage.written}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), json.loads(sys.argv[5]))
