"""Accelerate's documented "start from pretrained" path (docs/api.md): ``load_hf`` into the
prepared model, on 2 gloo ranks (``MULTI_CPU``: DDP), for ``save_pretrained`` folders of a tiny
GPT-2 and a tiny Llama (``tests/hf_models.py``).

    hf_load_worker.py FOLDERS RESULTS

The prepared model must equal ``from_pretrained``'s in one process bit for bit, and train a
step. Every rank writes its checks to ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tests.checks import Checks
from tests.hf_models import MODELS, differing, reference

checks = Checks()
check = checks.check


def start(path: Path, accelerator: Any) -> tuple[Any, Any]:
    """The documented code: a model from the folder's config, prepared, then filled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkeeper.core import load_hf

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    load_hf(path, accelerator.unwrap_model(model))  # every rank: the pieces it holds
    return model, optimizer


def main() -> None:
    folders, results = Path(sys.argv[1]), Path(sys.argv[2])
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    kind_of_run = accelerator.distributed_type.value
    check("the distributed type is MULTI_CPU", kind_of_run == "MULTI_CPU", kind_of_run)
    torch.set_num_threads(1)
    for kind in MODELS:
        folder = folders / kind
        want = reference(folder).state_dict()
        torch.manual_seed(1)  # from_config's random weights differ from the folder's
        model, optimizer = start(folder, accelerator)
        bad = differing(accelerator.unwrap_model(model).state_dict(), want)
        check(f"{kind}: the prepared model bit for bit against from_pretrained", not bad, bad)
        ids = torch.arange(16).reshape(2, 8) + 8 * checks.rank
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        check(f"{kind}: trains a step", bool(torch.isfinite(loss.detach())), loss)
    checks.write(results / f"r{checks.rank}.json")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
