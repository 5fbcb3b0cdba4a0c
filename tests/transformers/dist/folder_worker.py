"""A Trainer killed between a commit and its ``checkpoint-N`` folder (one process, CPU).

    folder_worker.py MODE OUT

``reference``: the tests' 12 steps uninterrupted into ``OUT/ref``; its losses and final state
go to ``OUT/reference.pt``. ``kill``: the same run into ``OUT/run`` (saves every 4, async),
SIGKILLed as soon as the manifest of step 8 is written: step 8 is committed, and nothing after
its commit ran (retention, the done-callbacks, its folder); ``OUT/killed`` is touched first.
``resume``: ``train(resume_from_checkpoint=True)`` on ``OUT/run``, whose losses and final
state must equal the reference's from step 8 on, bit for bit (checks in
``OUT/resume-rank0.json``). ``reference+kill``: both, in one launch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.checks import Checks, state_of  # noqa: E402
from tests.transformers.common import CONSTANT, make_trainer  # noqa: E402

from shardkeeper.core.commit.committed import manifest_path  # noqa: E402
from shardkeeper.transformers import plugin_of  # noqa: E402

KILL_AT = 8


def reference(out: Path) -> None:
    trainer = make_trainer(out / "ref", **CONSTANT)
    trainer.train()
    state = state_of(trainer.model, trainer.optimizer.optimizer)
    torch.save({"losses": trainer.losses, "state": state}, out / "reference.pt")


def kill(out: Path) -> None:
    trainer = make_trainer(out / "run", **CONSTANT)
    storage = plugin_of(trainer).manager().storage
    put = storage.put_if_absent

    def put_then_die(path: str, data: bytes) -> None:
        put(path, data)
        if path == manifest_path(KILL_AT):  # committed: die before anything follows the commit
            (out / "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)

    storage.put_if_absent = put_then_die  # type: ignore[method-assign]
    trainer.train()


def resume(out: Path) -> None:
    checks = Checks(out / "resume-rank0.json", rank=0)
    ref = torch.load(out / "reference.pt", weights_only=True)
    trainer = make_trainer(out / "run", **CONSTANT)
    trainer.train(resume_from_checkpoint=True)
    later = [x for x in ref["losses"] if x[0] >= KILL_AT]
    checks.check("resumed_at_the_committed_step", trainer.losses[:1] == later[:1], str(trainer.losses[:1]))
    checks.check("next_losses_bit_exact", trainer.losses == later, f"{trainer.losses[:3]} vs {later[:3]}")
    checks.same(
        "final_params_and_optimizer_bit_exact", state_of(trainer.model, trainer.optimizer.optimizer), ref["state"]
    )
    checks.write()


def main() -> None:
    modes, out = sys.argv[1], Path(sys.argv[2])
    for mode in modes.split("+"):
        {"reference": reference, "kill": kill, "resume": resume}[mode](out)


if __name__ == "__main__":
    main()
