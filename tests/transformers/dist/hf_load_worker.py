"""``load_hf`` of ``save_pretrained`` folders (a tiny GPT-2 and a tiny Llama, several shards)
into sharded models on gloo ranks, each compared bit for bit with ``from_pretrained`` in one
process (``tests/hf_models.py``).

    hf_load_worker.py FOLDERS RESULTS PARTS

``FOLDERS/gpt2`` and ``FOLDERS/llama`` hold the folders; ``PARTS`` is a comma-separated list of:

- ``fsdp2``: each block, then the root, ``fully_shard``-ed over every rank; reads through a
  storage that counts every byte (index, headers, tensors): this rank's at most 1.1 x its
  share, the ranks' together at most 1.1 x the folder's tensors;
- ``tp``: torch's tensor parallel over every rank (Llama: ``parallelize_module`` with column-
  and row-wise plans; GPT-2's ``Conv1D`` weights, stored (in, out), distributed by
  ``distribute_module``); the rest replicated, its reads deduplicated: the ranks' bytes
  together at most 1.1 x the folder's;
- ``rename``: the base model alone (``GPT2Model``, ``LlamaModel``), FSDP2-sharded, from the
  causal LM's folder by ``rename=`` (the prefix dropped, the LM head left out);
- ``cast``: a bfloat16 model, FSDP2-sharded, from the float32 folder with ``dtype=True``,
  against ``from_pretrained(..., dtype=torch.bfloat16)``;
- ``corrupt``: a copy of the GPT-2 folder with a truncated shard, then one with a forged
  header: every rank's load is a ``CorruptCheckpointError`` naming the file and the rank;
- ``trainer``: the documented ``model_init`` of a ``ShardkeeperTrainer`` (docs/api.md) at
  construction and again in ``train()``, which trains one step from it.

Every rank writes its checks to ``RESULTS/<PARTS>-w<world>-r<rank>.json``.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.checks import Checks
from tests.core._hf import CountingStorage
from tests.hf_models import MODELS, build, differing, folder_bytes, local_bytes, reference
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardkeeper.core import load_hf
from shardkeeper.core.errors import CorruptCheckpointError

checks = Checks()
check = checks.check


def summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def layers(model: Any) -> Any:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def fsdp2(model: nn.Module, mesh: DeviceMesh, blocks: Any = None) -> nn.Module:
    for block in blocks if blocks is not None else layers(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_parallel(kind: str, model: Any, mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

    if kind == "llama":
        col, row = ColwiseParallel(), RowwiseParallel()
        plan: dict[str, ParallelStyle] = {f"model.layers.*.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"model.layers.*.mlp.{p}": col for p in ("gate_proj", "up_proj")}
        plan |= {"model.layers.*.self_attn.o_proj": row, "model.layers.*.mlp.down_proj": row, "lm_head": col}
        return parallelize_module(model, mesh, plan)

    def conv1d(name: str, module: nn.Module, mesh: DeviceMesh) -> None:  # Conv1D: weight (in, out)
        if not name.endswith(("c_attn", "c_fc", "c_proj")):
            return
        column = not name.endswith("c_proj")  # c_attn, c_fc: split the outputs; c_proj: the inputs
        assert isinstance(module.weight, torch.Tensor) and isinstance(module.bias, torch.Tensor)
        weight = distribute_tensor(module.weight.data, mesh, [Shard(1 if column else 0)])
        bias = distribute_tensor(module.bias.data, mesh, [Shard(0) if column else Replicate()])
        module.weight, module.bias = nn.Parameter(weight), nn.Parameter(bias)

    for block in model.transformer.h:
        distribute_module(block, mesh, conv1d)
    return model


def fsdp2_part(folders: Path, mesh: DeviceMesh) -> None:
    for kind in MODELS:
        folder = folders / kind
        want = reference(folder).state_dict()
        model = fsdp2(build(kind, seed=1), mesh)
        storage = CountingStorage(folder)
        load_hf(storage, model)
        bad = differing(model.state_dict(), want)
        check(f"fsdp2 {kind}: bit for bit against from_pretrained", not bad, f"differ: {bad}")
        share, read, total = local_bytes(model.parameters()), storage.bytes_read, folder_bytes(folder)
        together = summed(read)
        print(f"hf_load fsdp2 {kind} w{dist.get_world_size()} r{dist.get_rank()}: read {read}, share {share}, "
              f"all ranks {together} of {total}", flush=True)  # fmt: skip
        check(f"fsdp2 {kind}: bytes read <= 1.1 x the rank's share", 0 < read <= 1.1 * share, f"{read} vs {share}")
        check(f"fsdp2 {kind}: bytes read over the ranks <= 1.1 x the model", together <= 1.1 * total,
              f"{together} vs {total}: {storage.by_file}")  # fmt: skip


def tp_part(folders: Path, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor

    for kind in MODELS:
        folder = folders / kind
        want = reference(folder).state_dict()
        model = tensor_parallel(kind, build(kind, seed=1), mesh)
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        check(f"tp {kind}: the projections are DTensors", len(sharded) >= 8, sharded)
        storage = CountingStorage(folder)
        got = load_hf(storage, model)
        bad = differing(model.state_dict(), want)
        check(f"tp {kind}: bit for bit against from_pretrained", not bad, f"differ: {bad}")
        together, total = summed(storage.bytes_read), folder_bytes(folder)
        received = summed(got.stats.bytes_received)
        print(f"hf_load tp {kind}: all ranks read {together} of {total}, received {received}", flush=True)
        check(f"tp {kind}: bytes read over the ranks <= 1.1 x the model", together <= 1.1 * total and received > 0,
              f"read {together}, received {received}, folder {total}")  # fmt: skip


def rename_part(folders: Path, mesh: DeviceMesh) -> None:
    for kind, base in (("gpt2", "transformer."), ("llama", "model.")):
        folder = folders / kind
        want = {k.removeprefix(base): v for k, v in reference(folder).state_dict().items() if k.startswith(base)}
        whole = build(kind, seed=1)
        model = fsdp2(getattr(whole, base[:-1]), mesh, blocks=layers(whole))

        def rename(name: str, base: str = base) -> str | None:
            return name.removeprefix(base) if name.startswith(base) else None

        got = load_hf(folder, model, rename=rename)
        bad = differing(model.state_dict(), want)
        check(f"rename {kind}: the base model bit for bit", not bad and len(got.keys) == len(want), f"{bad} {got.keys}")


def cast_part(folders: Path, mesh: DeviceMesh) -> None:
    for kind in MODELS:
        folder = folders / kind
        want = reference(folder, dtype=torch.bfloat16).state_dict()
        model = fsdp2(build(kind, seed=1, dtype=torch.bfloat16), mesh)
        load_hf(folder, model, dtype=True)
        bad = differing(model.state_dict(), want)
        check(f"cast {kind}: bfloat16 bit for bit against from_pretrained(dtype=bfloat16)", not bad, bad)


def _forge_past_end(raw: bytes) -> bytes:
    """The file with its first tensor's range ending past the data section (header rewritten)."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[name]["data_offsets"][1] += 1 << 20
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


def corrupt_part(folders: Path, mesh: DeviceMesh, results: Path) -> None:
    rank, file = dist.get_rank(), "model-00002-of-00007.safetensors"
    cases: dict[str, tuple[Callable[[bytes], bytes], str]] = {
        "truncated": (lambda raw: raw[:-5], "truncated"),
        "forged": (_forge_past_end, "leave the data section"),
    }
    for case, (edit, message) in cases.items():
        copy = results / f"corrupt-{case}"
        if rank == 0:
            shutil.copytree(folders / "gpt2", copy)
            (copy / file).write_bytes(edit((copy / file).read_bytes()))
        dist.barrier()
        model = fsdp2(build("gpt2", seed=1), mesh)
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        try:
            load_hf(copy, model)
            check(f"corrupt {case}: a clear error", False, "load_hf succeeded")
        except CorruptCheckpointError as e:
            text = str(e)
            ok = file in text and f"(rank {rank})" in text and message in text and "download it again" in text
            check(f"corrupt {case}: a clear error", ok, text)
        same = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
        check(f"corrupt {case}: nothing was written into the model", same)
        dist.barrier()


# -- the Trainer's documented path (docs/api.md, "The Hugging Face Trainer") ----------------------
def make_model_init(path: Path) -> Callable[[], Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkeeper.core import load_hf

    def model_init() -> Any:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        load_hf(path, model)  # every rank: reads deduplicated over the ranks
        return model

    return model_init


def at_start(want: dict[str, torch.Tensor], seen: dict[str, list[str]]) -> Any:
    """A callback noting in ``seen["bad"]`` the keys that differ from ``want`` as training starts."""
    from transformers import TrainerCallback

    class AtStart(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            seen["bad"] = differing(getattr(model, "module", model).state_dict(), want)

    return AtStart()


def trainer_part(folders: Path, results: Path) -> None:
    from tests.transformers.common import Tokens
    from transformers import TrainingArguments

    from shardkeeper.transformers import ShardkeeperTrainer

    for kind in MODELS:
        folder = folders / kind
        want = reference(folder).state_dict()
        torch.manual_seed(1)  # from_config's random weights differ from the folder's
        args = TrainingArguments(
            output_dir=str(results / f"trainer-{kind}"), max_steps=1, per_device_train_batch_size=2,
            report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-3,
        )  # fmt: skip
        trainer = ShardkeeperTrainer(model_init=make_model_init(folder), args=args, train_dataset=Tokens())
        assert trainer.model is not None
        bad = differing(trainer.model.state_dict(), want)
        check(f"trainer {kind}: model_init's model bit for bit against from_pretrained", not bad, bad)
        seen: dict[str, list[str]] = {}
        trainer.add_callback(at_start(want, seen))
        trainer.train()
        check(f"trainer {kind}: train() starts from the pretrained weights", seen.get("bad") == [], seen)
        check(f"trainer {kind}: and trains", trainer.state.global_step == 1, trainer.state.global_step)


def main() -> None:
    folders, results, parts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    run: dict[str, Callable[[], None]] = {
        "fsdp2": lambda: fsdp2_part(folders, mesh),
        "tp": lambda: tp_part(folders, mesh),
        "rename": lambda: rename_part(folders, mesh),
        "cast": lambda: cast_part(folders, mesh),
        "corrupt": lambda: corrupt_part(folders, mesh, results),
        "trainer": lambda: trainer_part(folders, results),
    }
    for part in parts:
        checks.guard(part, run[part])
    checks.write(results / f"{'+'.join(parts)}-w{world}-r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
