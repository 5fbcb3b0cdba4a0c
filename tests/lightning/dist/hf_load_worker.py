"""Lightning's documented "start from pretrained" path (docs/api.md): ``load_hf`` in
``configure_model`` after ``fully_shard`` (``ModelParallelStrategy``, data parallel over 2
gloo ranks), from transformers' own ``save_pretrained`` folder of a tiny Llama
(``tests/hf_models.py``).

    hf_load_worker.py FOLDER RESULTS

At the start of ``fit`` the sharded model must equal ``from_pretrained``'s in one process bit
for bit; then it trains a step. Every rank writes its checks to ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from tests.checks import Checks
from tests.hf_models import differing, reference
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from shardkeeper.core import load_hf

checks = Checks()
check = checks.check


class PretrainedLM(L.LightningModule):
    """The documented module."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.path))
        mesh = self.device_mesh["data_parallel"]  # type: ignore[index]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        load_hf(self.path, self.model)  # each rank reads the byte ranges of its shards

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)


class Checked(PretrainedLM):
    """The documented module, checked as ``fit`` starts (a collective)."""

    want: dict[str, torch.Tensor]

    def on_fit_start(self) -> None:
        sharded = [n for n, p in self.model.named_parameters() if hasattr(p, "to_local")]
        check("configure_model sharded the parameters", len(sharded) > 10, sharded)
        bad = differing(self.model.state_dict(), self.want)
        check("the sharded model at fit's start bit for bit against from_pretrained", not bad, bad)


def main() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    folder, results = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(1)  # from_config's random weights differ from the folder's
    module = Checked(str(folder))
    module.want = reference(folder).state_dict()
    ids = torch.arange(64).reshape(8, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, data)
    check("it trains a step", trainer.global_step == 1, trainer.global_step)
    checks.write(results / f"r{trainer.global_rank}.json")


if __name__ == "__main__":
    main()
