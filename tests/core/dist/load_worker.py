"""Saves for the target-free load test (run under torchrun at world size 2).

    load_worker.py ROOT

For each layout (FSDP2 and TP: every tensor sharded across the ranks) and each codec setting
(raw; zstd with encryption under the key in ``SK_LOAD_KEY``), trains two steps and saves a
state with JSON values, bytes and per-rank entries under ``ROOT/<layout>-<codec>``; rank 0
writes the full tensors (gathered from the shards) to ``ROOT/<layout>-<codec>.ref.pt``, the
reference the single-process ``load()`` is compared with bit for bit. Rank 1 also loads each
step alone with ``process_group="local"`` while the group is up, and leaves ``<name>.lone-ok``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build, full_state, train_step  # noqa: E402

from shardkeeper.core import CheckpointManager, PerRank, RNGState  # noqa: E402

CODECS = {"raw": {}, "zstd-enc": {"compression": "zstd", "encryption": "env:SK_LOAD_KEY"}}


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for layout in ("fsdp2", "tp"):
        for codec, options in CODECS.items():
            name = f"{layout}-{codec}"
            model, opt = build(layout, seed=3)
            for i in range(2):
                train_step(model, opt, i)
            state = {
                "model": model,
                "optim": opt,
                "meta": {"step": 2, "layout": layout, "lr": [0.1, 0.01]},
                "blob": bytes(range(256)) * 3,
                "rng": RNGState(),
                "note": PerRank({"rank": rank}),
                "half": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
            }
            ref = full_state(model, opt)  # a collective
            with CheckpointManager(root / name, digest_block_bytes=3000, **options) as mgr:
                mgr.save(2, state).wait()
            if rank == 0:
                torch.save(ref, root / f"{name}.ref.pt")
            if rank == 1:  # one rank alone while the group is up: a "local" manager is no collective
                with CheckpointManager(root / name, process_group="local", **options) as lone:
                    got = lone.load(only=["model/*"])["model"]
                bad = [k for k, v in got.items() if not torch.equal(v, ref[f"model/{k}"])]
                if bad or len(got) != sum(k.startswith("model/") for k in ref):
                    raise SystemExit(f"{name}: rank 1's lone load() differs from the gathered state: {bad}")
                (root / f"{name}.lone-ok").write_text("ok")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
