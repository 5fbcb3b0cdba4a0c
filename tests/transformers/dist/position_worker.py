"""The Trainer's data position across a change of world size (tests/transformers/test_trainer_position.py).

    position_worker.py MODE OUT [BATCH [ACCUMULATE]]

A Trainer (tiny GPT-2, CPU) over 32 numbered samples (sample ``i`` starts with token ``i``),
batches of 2 a rank (``BATCH`` in ``resume``), 2 epochs, a save every 2 steps. Each micro-step appends
``{"step", "epoch", "ids"}`` to ``OUT/<MODE>-r<rank>.jsonl`` as it is trained (``epoch``: the
sampler's). ``first`` (2 ranks, DDP): rank 0 writes the model and AdamW state of step 2 to
``OUT/saved.pt`` when it is saved; at the end of step 4 every rank waits for step 2's commit
and kills itself (SIGKILL), 8 steps an epoch: mid-epoch, 8 samples consumed. ``resume`` (1
process, batches of ``BATCH``: 2 resumes through the Trainer's skip of 4 batches, 3 from the
sampler's position, 8 being no whole number of batches; ``ACCUMULATE`` micro-batches a step):
``train(resume_from_checkpoint=True)``; the state the training starts from goes to
``OUT/resumed.pt`` and the resumed step to ``OUT/resumed-step``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.checks import state_of  # noqa: E402
from tests.transformers.common import SEQ, tiny_model  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from shardkeeper.transformers import ShardkeeperTrainer, plugin_of, wait  # noqa: E402

N, SEED, SAVED, KILLED = 32, 7, 2, 4


class Numbered(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample ``i``: token ``i`` followed by fixed random tokens (labels = inputs)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (N, SEQ), generator=g)
        self.ids[:, 0] = torch.arange(N)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Logged(ShardkeeperTrainer):
    """Appends each micro-step's sample ids to ``ids_file`` as it is trained."""

    ids_file: Any

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        sampler = plugin_of(self).data.sampler
        epoch = None if sampler is None else sampler.epoch
        ids = inputs["input_ids"][:, 0].tolist()
        self.ids_file.write(json.dumps({"step": self.state.global_step + 1, "epoch": epoch, "ids": ids}) + "\n")
        self.ids_file.flush()
        return loss


class Watch(TrainerCallback):
    def __init__(self, trainer: Logged, mode: str, out: Path) -> None:
        self.trainer, self.mode, self.out = trainer, mode, out

    def state(self) -> dict[str, Any]:
        optimizer: Any = self.trainer.optimizer
        return state_of(self.trainer.model, optimizer.optimizer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.mode == "resume":
            torch.save(self.state(), self.out / "resumed.pt")
            (self.out / "resumed-step").write_text(str(state.global_step))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.mode == "first" and state.global_step == SAVED and args.process_index == 0:
            torch.save(self.state(), self.out / "saved.pt")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.mode == "first" and state.global_step == KILLED:
            wait(self.trainer)  # step 2 committed; steps 3 and 4 never will be
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(out: Path, mode: str, rank: int, batch: int, accumulate: int = 1) -> Logged:
    args = TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate,
        num_train_epochs=2,
        save_strategy="steps",
        save_steps=SAVED,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        seed=SEED,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tr = Logged(model=tiny_model(), args=args, train_dataset=Numbered())
    tr.ids_file = open(out / f"{mode}-r{rank}.jsonl", "a")  # noqa: SIM115 - open until the process ends
    tr.add_callback(Watch(tr, mode, out))
    return tr


def main(mode: str, out_text: str, batch: str = "2", accumulate: str = "1") -> None:
    out = Path(out_text)
    rank = int(os.environ.get("RANK", "0"))
    tr = trainer(out, mode, rank, int(batch), int(accumulate))
    tr.train(resume_from_checkpoint=True if mode == "resume" else None)
    tr.ids_file.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
