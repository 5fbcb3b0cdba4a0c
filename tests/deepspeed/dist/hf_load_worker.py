"""``load_pretrained(engine, folder)``: real DeepSpeed ZeRO-3 engines on gloo/CPU started from
``save_pretrained`` folders (a tiny GPT-2 and a tiny Llama, several shards: ``tests/hf_models.py``).

    hf_load_worker.py FOLDERS RESULTS

For each model: an fp32 engine and a bf16 engine, built from a model of other random weights;
``load_pretrained`` reads through a storage that counts every byte (index, headers, tensors).
DeepSpeed's own ``safe_get_full_fp32_param`` of every parameter must equal ``from_pretrained``'s
float32 weights bit for bit, and the module's gathered weights those of ``from_pretrained``
in the engine's dtype; the ranks' bytes together at most 1.1 x the folder's tensors. A
bfloat16 folder (saved by the test beside the float32 one) loads with ``dtype=True`` into the
fp32 masters, exactly; without it, a ``StateMismatchError`` that names ``dtype=True``. Every
rank writes its checks to ``RESULTS/r<rank>.json``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed  # noqa: E402  (after torch, as DeepSpeed expects)
import torch
import torch.distributed as dist

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.utils.logger.setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=UserWarning)

from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from tests.checks import Checks  # noqa: E402
from tests.core._hf import CountingStorage  # noqa: E402
from tests.hf_models import MODELS, build, differing, folder_bytes, reference  # noqa: E402

from shardkeeper.core import StateMismatchError  # noqa: E402
from shardkeeper.deepspeed import load_pretrained  # noqa: E402

checks = Checks()
check = checks.check


def summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def engine_of(kind: str, dtype: str) -> Any:
    model = build(kind, seed=1)  # other weights than the folder's
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def masters(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full fp32 master weights by FQN (a collective)."""
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """The module's own weights, gathered (a collective)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def case(kind: str, dtype: str, folder: Path) -> None:
    name = f"zero3 {dtype} {kind}"
    want32 = {n: t for n, t in reference(folder).named_parameters()}  # the tied lm_head once, as DeepSpeed
    engine = engine_of(kind, dtype)
    storage = CountingStorage(folder)
    load_pretrained(engine, storage)
    bad = differing(masters(engine), want32)
    check(f"{name}: fp32 masters bit for bit against from_pretrained", not bad, bad)
    lp = torch.bfloat16 if dtype == "bf16" else torch.float32
    want = {n: t.detach() for n, t in reference(folder, dtype=lp).named_parameters()}
    bad = differing(weights(engine), want)
    check(f"{name}: module weights bit for bit against from_pretrained", not bad, bad)
    together, total = summed(storage.bytes_read), folder_bytes(folder)
    print(f"hf_load {name}: the ranks read {together} of {total}", flush=True)
    check(f"{name}: bytes read over the ranks <= 1.1 x the model", 0 < together <= 1.1 * total, f"{together}")


def bf16_folder(kind: str, folder: Path) -> None:
    name = f"zero3 bf16-folder {kind}"
    want = {n: t.detach().float() for n, t in reference(folder, dtype=torch.bfloat16).named_parameters()}
    engine = engine_of(kind, "bf16")
    try:
        load_pretrained(engine, folder)
        check(f"{name}: without dtype=True, a clear error", False, "loaded")
    except StateMismatchError as e:
        check(f"{name}: without dtype=True, a clear error", "dtype=True" in str(e), str(e))
    load_pretrained(engine, folder, dtype=True)
    bad = differing(masters(engine), want)
    check(f"{name}: dtype=True casts into the fp32 masters exactly", not bad, bad)


def main() -> None:
    folders, results = Path(sys.argv[1]), Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for kind in MODELS:
        for dtype in ("fp32", "bf16"):
            checks.guard(f"zero3 {dtype} {kind}", partial(case, kind, dtype, folders / kind))
        checks.guard(f"bf16 folder {kind}", partial(bf16_folder, kind, folders / f"{kind}-bf16"))
    checks.write(results / f"r{dist.get_rank()}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
