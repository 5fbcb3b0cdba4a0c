"""What logical digests (docs/format.md, "Logical digests") cost a save and a restore: one
process saves a state with them and without (``shardkeeper.core.save.logical.ENABLED``), in
alternating rounds, and prints the medians of the save's wall time (``save()`` to committed)
and of the process's CPU time, with the difference; then restores the saved step into a
target with the restore's check (``logical_check="error"``) and without (``"off"``), likewise.

    python benchmarks/logical_cost.py                  # 256 MiB: 4 x 32 MiB float32 + 4 x 32 MiB bfloat16
    python benchmarks/logical_cost.py --mib 1024 --rounds 3
    python benchmarks/logical_cost.py --small          # 10,000 small tensors (case b's state)
    python benchmarks/logical_cost.py --workdir /data/tmp

The digest runs on the writer's I/O threads beside the block digests, so the caller's stall
does not change; the figures are of the whole save (its background part included).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

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
    args = ap.parse_args()
    st = state(args.mib, args.small)
    nbytes = sum(t.numel() * t.element_size() for t in st.values())
    work = Path(tempfile.mkdtemp(prefix="logical-cost-", dir=args.workdir))
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        with CheckpointManager(work / "root", keep_last=1) as mgr:
            step = 0
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
        restores = restore_rounds(work / "root", st, args.rounds)
    finally:
        logical.ENABLED = True
        shutil.rmtree(work, ignore_errors=True)
    what = "10,000 small tensors" if args.small else f"{nbytes / 2**20:.0f} MiB in 8 tensors"
    print(f"{what}, {args.rounds} rounds each, medians (torch threads: {torch.get_num_threads()}):")
    report("save", "logical digests", times)
    report("restore", "the logical check", restores)


def restore_rounds(root: Path, st: dict[str, torch.Tensor], rounds: int) -> dict[bool, list[tuple[float, float]]]:
    """The newest step of ``root`` restored into zeros like ``st``, checked and not, alternating."""
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    mgrs = {on: CheckpointManager(root, logical_check="error" if on else "off") for on in (True, False)}
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds + 1):
        for on in (r % 2 == 0, r % 2 != 0):
            t0, c0 = time.perf_counter(), time.process_time()
            mgrs[on].restore(target)
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
