"""Case (e): a manifest with 100,000 tensors from 8 ranks: commit time and restore planning time.

    python benchmarks/case_e.py --workdir DIR --out result.json [--quick]

run.py runs this in its own process (with a timeout) and puts what it prints into the results.

"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

N_TENSORS = 100_000
N_RANKS = 8


def _reports(n_tensors: int, n_ranks: int, sharded: bool) -> list[dict[str, Any]]:
    """What 8 ranks report for a state of ``n_tensors`` [1024, 256] float32 tensors: each
    tensor row-sharded over all ranks (FSDP: 8 chunks a tensor), or owned whole by one rank."""
    from shardkeeper.core.assemble import declared_digest

    rows = 1024 // n_ranks
    declared = {
        f"model/layers.{i // 100}.block.{i % 100}.weight": ["tensor", "float32", [1024, 256]] for i in range(n_tensors)
    }
    digest = declared_digest(declared)
    out = []
    for r in range(n_ranks):
        f = f"data/r{r:05d}-0123abcd-000.safetensors"
        chunks: dict[str, list[dict[str, Any]]] = {}
        for i, key in enumerate(declared):
            if sharded:
                n = rows * 256 * 4
                chunks[key] = [
                    {
                        "file": f,
                        "offset": 4096 + i * n,
                        "length": n,
                        "offsets": [r * rows, 0],
                        "shape": [rows, 256],
                        "digests": ",".join([f"{i:032x}"] * (-(-n // 65536))),
                    }
                ]
            elif i % n_ranks == r:
                n = 1024 * 256 * 4
                chunks[key] = [
                    {
                        "file": f,
                        "offset": 4096 + i * n,
                        "length": n,
                        "offsets": [0, 0],
                        "shape": [1024, 256],
                        "digests": ",".join([f"{i:032x}"] * (n // 65536)),
                    }
                ]
        # the size the file would have: readers check every chunk lies inside its file
        size = max((c["offset"] + c["length"] for cs in chunks.values() for c in cs), default=0)
        out.append(
            {
                "ok": True,
                "rank": r,
                "declared": declared if r == 0 else {},
                "declared_digest": digest,
                "chunks": chunks,
                "files": {f: {"size_bytes": size, "rank": r}},
                "objects": {},
                "per_rank_prefixes": [],
            }
        )
    return out


def _measure(workdir: Path, n_tensors: int, n_ranks: int, sharded: bool) -> dict[str, Any]:

    from shardkeeper.core.assemble import assemble_manifest
    from shardkeeper.core.commit import manifest_path
    from shardkeeper.core.format.table import encode_report, no_gc
    from shardkeeper.core.storage import LocalStorage
    from shardkeeper.core.tensor import (
        coordination,
        restore,  # noqa: F401  (imported before timing, as in a restoring process)
    )

    _loads = getattr(coordination, "_loads", json.loads)  # how the coordinator parses reports

    reports = _reports(n_tensors, n_ranks, sharded)
    # other ranks' reports arrive as JSON via the store, chunks in columns (StoreCoordinator.report)
    wire = [json.dumps({**r, "chunks": encode_report(r["chunks"], 0)}) for r in reports[1:]]
    storage = LocalStorage(workdir / ("sharded" if sharded else "whole"))
    # commit: decode the reports, merge and check tiling, serialize, write the manifest durably
    t0 = time.perf_counter()
    got = [reports[0]] + [_loads(w.encode()) for w in wire]
    m = assemble_manifest(1, "bench", got, world_size=n_ranks, digest="xxh3_128", block_bytes=65536, metadata={})
    data = m.dumps()
    storage.put_if_absent(manifest_path(1), data)
    commit_s = time.perf_counter() - t0
    del got, m
    # planning, for rank 0 of the same layout: read and validate the manifest, then find the
    # byte ranges of each of its 100,000 target pieces (the reads themselves not included)
    rows = 1024 // n_ranks if sharded else 1024
    t1 = time.perf_counter()
    with no_gc():  # restore_flat plans with garbage collection paused, too
        manifest, ops, reads = _plan(storage, rows, sharded)
    plan_s = time.perf_counter() - t1
    return {
        "commit_s": commit_s,
        "plan_s": plan_s,
        "manifest_bytes": len(data),
        "chunks": sum(len(r["chunks"]) for r in reports),
        "overlaps": len(ops),
        "reads": len(reads),
    }


def _plan(storage: Any, rows: int, sharded: bool) -> tuple[Any, list[Any], list[Any]]:
    import torch

    from shardkeeper.core.commit import load_manifest
    from shardkeeper.core.format.table import TableLeaves
    from shardkeeper.core.tensor.chunks import Piece
    from shardkeeper.core.tensor.restore_plan import overlap_ops, plan_reads

    local = torch.empty((rows, 256), device="meta")
    manifest = load_manifest(storage, 1)
    ops = []
    leaves = manifest.leaves
    table = leaves if isinstance(leaves, TableLeaves) else None  # as restore_flat does
    for key in leaves:
        leaf = table.head(key) if table is not None else leaves[key]
        piece = Piece((0, 0), (rows, 256), local)
        chunks = leaf.chunks if table is None else table.overlapping(key, piece.offsets, piece.shape)
        for c in chunks:
            ops.extend(overlap_ops(key, piece, c, torch.float32, 4, 64 << 20))
    reads = plan_reads(ops, manifest.digest_block_bytes, 8 << 20)
    return manifest, ops, reads


def measure_manifest_scale(workdir: Path, *, n_tensors: int = N_TENSORS, n_ranks: int = N_RANKS) -> dict[str, Any]:
    """Case (e): commit time and restore planning time of a 100,000-tensor, 8-rank manifest.

    Two layouts: every tensor row-sharded over the 8 ranks (FSDP; 800,000 chunks, the
    reported ``commit_s``/``plan_s``), and every tensor owned whole by one rank (100,000
    chunks, reported as ``whole``). Synthetic reports, real code: the coordinator's merge,
    the manifest's serialization and durable write, its parse and validation, and restore
    planning for one rank.
    """
    sharded = _measure(workdir, n_tensors, n_ranks, sharded=True)
    whole = _measure(workdir, n_tensors, n_ranks, sharded=False)
    return {**sharded, "layout": "row-sharded over all ranks", "whole": whole}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="10,000 tensors instead of 100,000")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    n = N_TENSORS // 10 if args.quick else N_TENSORS
    try:
        res = measure_manifest_scale(work, n_tensors=n, n_ranks=N_RANKS)
    except Exception as e:  # a broken measurement must not lose the rest of the run
        res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
