"""``load_hf`` on 2 gloo ranks.

    hf_load_worker.py HF_DIR RESULTS

FSDP2: each rank's ``TinyLM`` sharded with ``fully_shard`` (each block, then the root, whose
group holds the tied embedding and ``lm_head`` as one parameter); ``load_hf`` reads through a
storage that counts every byte read (index, headers, tensors); each parameter's full tensor
must equal the folder's bit for bit, and this rank's bytes read be at most 1.1 x the bytes
of its shards. Replicated: a plain ``TinyLM`` on both ranks; with replica-deduplicated reads
the bytes the ranks read together are at most 1.1 x the folder's tensors, and peers sent
bytes. Every rank writes its checks to ``RESULTS/r<R>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardkeeper.core import load_hf
from tests.checks import Checks
from tests.core._hf import CountingStorage, TinyLM, same_bits

checks = Checks()
check = checks.check


def folder_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def differing(model: TinyLM, src: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose full tensor is not the folder's (a collective for DTensors)."""
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want = src["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        if not same_bits(full.detach(), want):
            bad.append(name)
    return bad


def fsdp2(path: Path, src: dict[str, torch.Tensor]) -> None:
    model = TinyLM(seed=1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    storage = CountingStorage(path)
    got = load_hf(storage, model)
    bad = differing(model, src)
    check("fsdp2: bit for bit", not bad, f"differ: {bad}")
    share = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        share += local.numel() * local.element_size()
    detail = f"read {storage.bytes_read} ({storage.by_file}), share {share}, stats {got.stats}"
    print(f"hf_load fsdp2, rank {dist.get_rank()}: read {storage.bytes_read} bytes, share {share}", flush=True)
    check("fsdp2: bytes read <= 1.1 x the rank's share", 0 < storage.bytes_read <= 1.1 * share, detail)


def replicated(path: Path, src: dict[str, torch.Tensor]) -> None:
    model = TinyLM(seed=2)
    storage = CountingStorage(path)
    got = load_hf(storage, model)
    bad = differing(model, src)
    check("replicated: bit for bit", not bad, f"differ: {bad}")
    total = sum(t.numel() * t.element_size() for t in src.values())
    read, received = summed(storage.bytes_read), summed(got.stats.bytes_received)
    print(f"hf_load replicated: the ranks read {read} bytes, received {received}, folder {total}", flush=True)
    check(
        "replicated: bytes read over the ranks <= 1.1 x the folder",
        read <= 1.1 * total and received > 0,
        f"read {read}, received {received}, folder {total}",
    )


def main() -> None:
    path, results = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    src = folder_tensors(path)
    checks.guard("fsdp2", lambda: fsdp2(path, src))
    checks.guard("replicated", lambda: replicated(path, src))
    checks.write(results / f"r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
