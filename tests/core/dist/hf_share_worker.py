"""``load_hf`` into a replicated (plain) target on 2 gloo ranks: its peak memory, and
``SHARDKEEPER_SHARE_RESTORE_READS=0``.

    hf_share_worker.py HF_DIR RESULTS

Every rank loads the whole folder into tensors made by ``torch.empty`` (pages untouched until
the load writes them). With replica-deduplicated reads, each range is read by one rank and
sent to the other, and the load's peak RSS (VmHWM reset just before it, minus the RSS then)
stays within 1.4 x the folder's tensors: the exchange holds a few pieces at a time, not the
whole model. Then, with ``SHARDKEEPER_SHARE_RESTORE_READS=0`` in the environment (set here,
before the call), every rank reads the whole folder itself and receives nothing. Both loads
are compared bit for bit with the folder. Every rank writes its checks to ``RESULTS/r<R>.json``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from shardkeeper.core import load_hf
from tests.checks import Checks
from tests.core._hf import INDEX, CountingStorage, same_bits

checks = Checks()
check = checks.check
PEAK = 1.4


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def shapes(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118  (safe_open is not a mapping)
                t = sf.get_slice(name)
                out[name] = (torch.Size(t.get_shape()), getattr(torch, {"F32": "float32"}[t.get_dtype()]))
    return out


def differing(path: Path, target: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118
                if not same_bits(target[name], sf.get_tensor(name)):
                    bad.append(name)
    return bad


def shared(path: Path, total: int) -> None:
    target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes(path).items()}
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    got = load_hf(CountingStorage(path), target)
    peak = _status_bytes("VmHWM") - before
    bad = differing(path, target)
    check("shared: bit for bit", not bad, f"differ: {bad}")
    check("shared: peers sent bytes", got.stats.bytes_received > 0, str(got.stats))
    ratio = peak / total
    print(f"hf_share rank {dist.get_rank()}: peak {peak} bytes above the start, {ratio:.3f} x the model", flush=True)
    check(f"shared: peak RSS <= {PEAK} x the model", ratio <= PEAK, f"peak {peak}, model {total}, {ratio:.3f}")


def unshared(path: Path, total: int) -> None:
    os.environ["SHARDKEEPER_SHARE_RESTORE_READS"] = "0"
    target = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in shapes(path).items()}
    storage = CountingStorage(path)
    got = load_hf(storage, target)
    bad = differing(path, target)
    check("unshared: bit for bit", not bad, f"differ: {bad}")
    tensors = storage.bytes_read - storage.by_file.get(INDEX, 0)
    check(
        "unshared: every rank reads all it loads, receives nothing",
        got.stats.bytes_received == 0 and got.stats.bytes_read >= total and tensors >= total,
        f"stats {got.stats}, read {storage.bytes_read} ({storage.by_file}), model {total}",
    )


def main() -> None:
    path, results = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    total = sum(s.numel() * d.itemsize for s, d in shapes(path).values())
    checks.guard("shared", lambda: shared(path, total))
    checks.guard("unshared", lambda: unshared(path, total))
    checks.write(results / f"r{dist.get_rank()}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
