"""One torchrun launch (3 ranks) for the chunk codecs (docs/codecs.md) and the object stores.

    codecs_worker.py RESULTS SPEC_JSON

SPEC_JSON is a list of runs ``{"name", "url", "options", "mode"}``, each on its own empty
root; ``mode`` is ``plain``, ``codecs`` (``incremental=True``, ``compression="zstd"``) or
``encrypted`` (codecs and ``encryption=``). In each run, ranks 0 and 1 save, in a 2-rank
process group, an FSDP2 module (``fully_shard`` on a 2-rank mesh) and DTensors sharded over
the same mesh, two steps, asynchronously; rank 2 waits. Then all 3 ranks restore into an FSDP2
module and DTensors on a 3-rank mesh (resharded 2 -> 3), whole and partially; with
``encrypted`` a restore with a wrong key must fail on every rank. Each rank writes
``RESULTS/r<rank>.json``: its checks (``tests.checks.Checks``), named after the run first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardkeeper.core import CheckpointManager
from tests.checks import Checks, assert_same_state

ROWS, COLS = 96, 64


def _full() -> dict[str, torch.Tensor]:
    """The global tensors, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(5)
    return {
        "frozen": torch.randn(ROWS, COLS, generator=g),  # raw (random mantissas)
        "emb": (torch.randn(ROWS, COLS, generator=g) * 0.02).to(torch.bfloat16),  # compresses
        "mask": (torch.rand(ROWS, COLS * 16, generator=g) > 0.9).float(),  # compresses well
    }


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(COLS, ROWS)


def _dtensors(full: dict[str, torch.Tensor], mesh: DeviceMesh, rank: int, n: int) -> dict[str, Any]:
    out = {}
    for k, t in full.items():
        rows = ROWS // n
        out[k] = DTensor.from_local(t[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)
    return out


def main(results: Path, spec: list[dict[str, Any]]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = Checks(results / f"r{rank}.json", rank=rank)
    g2 = dist.new_group([0, 1])
    mesh3 = init_device_mesh("cpu", (3,))
    for run in spec:

        def check(case: str, fn: Any, name: str = run["name"]) -> None:
            checks.run(f"{name}: {case}", fn)

        one_run(run["url"], run["mode"], run["options"], rank, g2, mesh3, check)
    checks.write()
    dist.barrier()
    dist.destroy_process_group()


def one_run(root: str, mode: str, storage_options: dict[str, Any], rank: int, g2: Any, mesh3: DeviceMesh,
            check: Any) -> None:
    codecs, encrypted = mode in ("codecs", "encrypted"), mode == "encrypted"
    opts: dict[str, Any] = {"min_file_bytes": 1 << 14, "storage_options": storage_options}
    if codecs:
        opts.update(incremental=True, compression="zstd")
    if encrypted:
        from shardkeeper.core import LocalKeyProvider

        opts["encryption"] = LocalKeyProvider(bytes(range(32)))
    full = _full()
    ref = _linear(1)
    ref_w, ref_b = ref.weight.detach().clone(), ref.bias.detach().clone()
    ref_w2 = ref_w + 1
    if rank < 2:

        def save() -> None:
            mesh2 = DeviceMesh.from_group(g2, "cpu")
            lin = _linear(1)
            fully_shard(lin, mesh=mesh2)
            extra = _dtensors(full, mesh2, rank, 2)
            with CheckpointManager(root, process_group=g2, **opts) as mgr:
                h = mgr.save(1, {"model": lin, "extra": extra})  # async
                with torch.no_grad():
                    lin.weight.add_(1.0)  # changed after staging: step 1 keeps the old values
                h.wait()
                mgr.save(2, {"model": lin, "extra": extra})
                mgr.wait()
                if rank == 0 and codecs:
                    m = mgr.manifest(2).leaves
                    for k in ("extra/frozen", "extra/emb", "extra/mask", "model/bias"):
                        assert all(c.file.startswith("../step-000000000001/") for c in m[k].chunks), (k, m[k].chunks)
                    assert all(c.file.startswith("data/") for c in m["model/weight"].chunks)
                    assert {c.encoding for c in m["extra/mask"].chunks} == {"shuffle-zstd"}
                    assert {c.encoding for c in m["extra/frozen"].chunks} == {"raw"}

        check(f"save w2 (async, {mode})", save)
    dist.barrier()

    def restore(step: int, weight: torch.Tensor) -> None:
        lin = _linear(99)
        fully_shard(lin, mesh=mesh3)
        extra = {k: distribute_tensor(torch.zeros_like(t), mesh3, [Shard(0)]) for k, t in full.items()}
        with CheckpointManager(root, **opts) as mgr:
            assert mgr.restore({"model": lin, "extra": extra}, step=step) == step
            st = mgr.last_restore_stats
        got = {"weight": lin.weight.full_tensor(), "bias": lin.bias.full_tensor(),
               **{k: v.full_tensor() for k, v in extra.items()}}
        assert_same_state(got, {"weight": weight, "bias": ref_b, **full}, what=f"step {step} restored at w3")
        assert st is not None and st.bytes_read > 0

    check("restore step 1 at w3 (resharded 2 -> 3)", lambda: restore(1, ref_w))
    check("restore step 2 at w3", lambda: restore(2, ref_w2))

    def partial() -> None:
        lin = _linear(99)
        before = lin.weight.detach().clone()
        fully_shard(lin, mesh=mesh3)
        extra = {k: distribute_tensor(torch.zeros_like(t), mesh3, [Shard(0)]) for k, t in full.items()}
        with CheckpointManager(root, **opts) as mgr:
            mgr.restore({"model": lin, "extra": extra}, only=["extra/mask", "extra/emb"])
            st = mgr.last_restore_stats
        got = {"mask": extra["mask"].full_tensor(), "emb": extra["emb"].full_tensor(),
               "weight": lin.weight.full_tensor()}
        assert_same_state(got, {"mask": full["mask"], "emb": full["emb"], "weight": before}, what="the partial restore")
        assert not extra["frozen"].full_tensor().any()
        # A compressed chunk is read whole: honest accounting may exceed what was needed.
        assert st is not None and st.bytes_needed > 0 and st.bytes_read > 0
        if not codecs:  # ranged reads: a third of the rows plus whole 64 KiB digest blocks at the ends
            whole = sum(full[k].numel() * full[k].element_size() for k in ("mask", "emb"))
            assert st.bytes_read < whole / 2, (st.bytes_read, st.bytes_needed, whole)

    check("partial restore at w3", partial)
    if encrypted:

        def wrong_key() -> None:
            from shardkeeper.core import EncryptionKeyError, LocalKeyProvider

            lin = _linear(99)
            fully_shard(lin, mesh=mesh3)
            bad = {**opts, "encryption": LocalKeyProvider(bytes(32))}
            with CheckpointManager(root, **bad) as mgr:
                try:
                    mgr.restore({"model": lin}, strict=False)
                except EncryptionKeyError as e:
                    assert "wrong key" in str(e), e
                else:
                    raise AssertionError("a wrong key restored")

        check("wrong key fails on every rank at w3", wrong_key)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
