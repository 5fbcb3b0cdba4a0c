"""Case (e): a manifest with 100,000 tensors from 8 ranks: commit time and restore planning time.

    python benchmarks/case_e.py --workdir DIR --out result.json [--quick]

run.py runs this in its own process (with a timeout) and puts what it prints into the results.

# ---------------------------------------------------------------------------------------------
# STUB, to be filled in: ``measure_manifest_scale`` below. It calls
# ``shardkeeper.core.tensor.benchmarks_support.measure_manifest_scale`` when that module exists
# (it is being added to the core) and otherwise records "not measured". Expected return value:
# a dict with at least ``commit_s`` (merge 8 ranks' reports, check tiling, write the manifest)
# and ``plan_s`` (plan a restore against that manifest), in seconds; anything else it returns
# is kept in the results as is. Targets (issue 3): <= 2 s each.
# ---------------------------------------------------------------------------------------------
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

N_TENSORS = 100_000
N_RANKS = 8


def measure_manifest_scale(workdir: Path, *, n_tensors: int = N_TENSORS, n_ranks: int = N_RANKS) -> dict[str, Any]:
    """STUB (case e): commit time and restore planning time of a 100,000-tensor, 8-rank manifest."""
    try:
        from shardkeeper.core.tensor import benchmarks_support  # type: ignore[attr-defined]
    except ImportError:
        return {"status": "not measured",
                "reason": "shardkeeper.core.tensor.benchmarks_support does not exist yet"}
    fn = getattr(benchmarks_support, "measure_manifest_scale", None)
    if fn is None:
        return {"status": "not measured",
                "reason": "benchmarks_support has no measure_manifest_scale(workdir, n_tensors, n_ranks)"}
    t0 = time.perf_counter()
    res = dict(fn(workdir=workdir, n_tensors=n_tensors, n_ranks=n_ranks))
    res.setdefault("wall_s", time.perf_counter() - t0)
    return {"status": "measured", "n_tensors": n_tensors, "n_ranks": n_ranks, **res}


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
