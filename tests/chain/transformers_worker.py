"""Hop 5: the Hugging Face Trainer (DDP, world size 2) as ``ShardkeeperTrainer``
(docs/transformers.md): ``train(resume_from_checkpoint=True)`` from the root, whose newest step
Accelerate wrote, trains 2 steps, and its save at the end lands at the step loaded + 2.

    transformers_worker.py ROOT OUT
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from shardkeeper.transformers import ShardkeeperTrainer  # noqa: E402
from tests.chain.common import Hop, adam, add_layers, batch, committed_steps, forward, record, run_hop  # noqa: E402

STEPS = 2


class StepNet(nn.Module):
    """The chain's model (the same FQNs), taking the step of its batch from the data."""

    def __init__(self) -> None:
        super().__init__()
        add_layers(self)
        self.rank = int(os.environ.get("RANK", "0"))

    def forward(self, step: torch.Tensor) -> dict[str, torch.Tensor]:
        x, y = batch(int(step.reshape(-1)[0]), self.rank)
        return {"loss": (forward(self, x) - y).pow(2).mean()}


class Steps(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(i)}


class AfterLoad(TrainerCallback):
    """What the Trainer holds when training begins: after the resume, before any step."""

    def __init__(self, hop: Hop, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.hop, self.model, self.opt = hop, model, opt
        self.seen: tuple[int, dict[str, torch.Tensor]] | None = None

    def on_train_begin(self, args, state, control, **kw) -> None:  # type: ignore[no-untyped-def]
        params = dict(self.model.named_parameters())
        self.seen = (state.global_step, record(params, {n: self.opt.state.get(p, {}) for n, p in params.items()}))


def run(hop: Hop, root: str) -> None:
    torch.manual_seed(100 + hop.index)
    loaded = max(committed_steps(root))
    model = StepNet()
    opt = adam(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    args = TrainingArguments(
        output_dir=root,
        per_device_train_batch_size=1,
        max_steps=loaded + STEPS,
        save_strategy="steps",
        save_steps=loaded + STEPS,  # one save: at the end
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    watch = AfterLoad(hop, model, opt)
    trainer = ShardkeeperTrainer(
        model=model, args=args, train_dataset=Steps(), optimizers=(opt, sched), callbacks=[watch]
    )
    before = committed_steps(root)
    trainer.train(resume_from_checkpoint=True)
    assert watch.seen is not None
    step, state = watch.seen
    hop.loaded(step, state)
    hop.counter("trainer.state.global_step", step, loaded)
    params = dict(model.named_parameters())
    hop.saved(
        before,
        committed_steps(root),
        loaded + STEPS,
        record(params, {n: opt.state.get(p, {}) for n, p in params.items()}),
        f"the Trainer's save at global_step = {trainer.state.global_step}",
    )


if __name__ == "__main__":
    run_hop("transformers", run)
