"""What the Trainer tests share: a tiny GPT-2 from a config (dropout on, so a resume needs the
RNG back), fixed token data, and a ShardkeeperTrainer that records every micro-step's loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import TrainingArguments

from shardkeeper.transformers import ShardkeeperTrainer

SAMPLES, SEQ, STEPS, SAVE_EVERY = 24, 16, 12, 4
#: A constant learning rate: runs of different lengths train alike.
CONSTANT = {"lr_scheduler_type": "constant"}


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (labels = inputs: causal LM loss)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(*, tied: bool = True) -> Any:
    """``tied``: the LM head shares the token embedding (GPT-2's default)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=tied
    )
    return transformers.GPT2LMHeadModel(config)  # dropout 0.1: the resume needs the RNG back


class Recording(ShardkeeperTrainer):
    """Records each micro-step's loss (exact bytes) with the step it belongs to."""

    losses: list[tuple[int, str]]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append((int(self.state.global_step), loss.detach().double().item().hex()))
        return loss


def make_trainer(
    root: Path,
    *,
    options: dict[str, Any] | None = None,
    evaluate: bool = False,
    cls: type[Recording] | None = None,
    model: Any = None,
    callbacks: list[Any] | None = None,
    **more: Any,
) -> Recording:
    """A recording ShardkeeperTrainer into ``root``: 12 steps of batches of 4 (6 steps an
    epoch, over the ranks of a DDP launch), a save every 4; ``evaluate``: with an eval
    dataset; ``cls``: a subclass of ``Recording``; ``model``: instead of ``tiny_model()``;
    ``callbacks``: the Trainer's; ``more`` overrides arguments."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    params: dict[str, Any] = {
        "output_dir": str(root),
        "per_device_train_batch_size": 4 // world,
        "max_steps": STEPS,
        "save_strategy": "steps",
        "save_steps": SAVE_EVERY,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "seed": 7,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **more,
    }
    trainer = (cls or Recording)(
        model=tiny_model() if model is None else model,
        args=TrainingArguments(**params),
        train_dataset=Tokens(),
        eval_dataset=Tokens() if evaluate else None,
        shardkeeper_options=options,
        callbacks=callbacks,
    )
    trainer.losses = []
    return trainer
