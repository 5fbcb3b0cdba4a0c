"""Replica-deduplicated restore on 4 gloo ranks.

    share_worker.py ROOT

At replication 4 (plain tensors: every rank restores all of them, as under DDP), 2 (DTensors
on a 2 x 2 mesh, replicated over its first dimension and sharded over its second, as under
HSDP) and 1 (DTensors sharded over all 4 ranks): save, restore into zeroed targets, compare
bit for bit, and check that the bytes read from storage summed over the ranks are at most
1.05 x the bytes the step's data files hold. The same restore with
``share_restore_reads=False`` (every rank reads all it restores) is the comparison. Then, at
replication 4: a flipped byte inside a shared range (every rank falls back to the older step;
an explicit step raises on every rank), and a partial restore on one rank only. Rank 0
writes the measured ratios to ``ROOT/ratios.json``; every rank its checks to
``ROOT/results/share-r<R>.json``.
"""

from __future__ import annotations

import errno
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardkeeper.core import CheckpointManager, CheckpointRestoreError, CorruptCheckpointError, StorageError
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.testing.faults import FaultyStorage
from tests.checks import Checks

checks = Checks()
check = checks.check

SHAPES = {"big": ((1024, 512), torch.float32), "mid": ((300, 100), torch.float32), "odd": ((18, 7), torch.int64)}
SHAPES["half"] = ((64, 33), torch.bfloat16)


def full_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    return out


def placed(values: dict[str, torch.Tensor], rep: int) -> dict[str, torch.Tensor]:
    """``values`` laid out at replication ``rep`` (a collective for DTensors)."""
    if rep == 4:
        return {k: v.clone() for k, v in values.items()}
    if rep == 2:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        return {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in values.items()}
    mesh = init_device_mesh("cpu", (4,))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in values.items()}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], keys: list[str]) -> list[str]:
    bad = []
    for k in keys:
        a, b = local(got[k]), local(want[k])
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(k)
    return bad


def zeroed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(
                torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape, stride=v.stride()
            )
        else:
            out[k] = torch.zeros_like(v)
    return out


def data_bytes(root: Path, step: int) -> int:
    return sum(f.stat().st_size for f in (root / f"step-{step:012d}" / "data").iterdir())


def summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    checks.guard("whole run", lambda: run(root, rank))
    checks.write(root / "results" / f"share-r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def run(root: Path, rank: int) -> None:
    ratios: dict[str, float] = {}
    for rep in (4, 2, 1):
        ckpt = root / f"rep{rep}"
        src = placed(full_values(rep), rep)
        with CheckpointManager(ckpt, digest_block_bytes=4096) as mgr:
            mgr.save(1, src).wait()
        held = data_bytes(ckpt, 1)
        for share in (True, False):
            target = zeroed(src)
            with CheckpointManager(ckpt, share_restore_reads=share) as mgr:
                mgr.restore(target)
                st = mgr.last_restore_stats
            assert st is not None
            name = f"replication {rep}{'' if share else ', not shared'}"
            bad = same_bits(target, src, list(SHAPES))
            check(f"{name}: bit for bit", not bad, f"differ: {bad}")
            ratio = summed(st.bytes_read) / held
            received = summed(st.bytes_received)
            ratios[name] = round(ratio, 4)
            if share:
                check(f"{name}: read <= 1.05 x the checkpoint", ratio <= 1.05, f"ratio {ratio:.4f}")
                check(f"{name}: peers sent bytes", (received > 0) == (rep > 1), f"received {received}")
            else:
                check(f"{name}: nothing received", received == 0, f"received {received}")
                if rep == 4:
                    check(f"{name}: every rank read it all (control)", ratio >= 3.5, f"ratio {ratio:.4f}")
    if rank == 0:
        (root / "ratios.json").write_text(json.dumps(ratios))
    corrupt_shared(root / "rep4", rank)
    partial_on_one_rank(root / "rep4", rank)
    owner_read_fails(root / "rep4", rank)


def corrupt_shared(ckpt: Path, rank: int) -> None:
    """Step 2 holds other values; a byte of its ``big`` (a range every rank needs, read by one
    and sent) is flipped on disk: the receivers' check fails as the owner's does."""
    v1 = placed(full_values(4), 4)
    v2 = placed(full_values(40), 4)
    with CheckpointManager(ckpt, digest_block_bytes=4096) as mgr:
        mgr.save(2, v2).wait()
    if rank == 0:
        needle = v2["big"].numpy().tobytes()[:64]
        for f in (ckpt / "step-000000000002" / "data").iterdir():
            raw = bytearray(f.read_bytes())
            at = raw.find(needle)
            if at >= 0:
                raw[at + (1 << 20)] ^= 0x40
                f.write_bytes(bytes(raw))
                break
        else:
            raise AssertionError("big's bytes not found in step 2's files")
    dist.barrier()
    try:
        with CheckpointManager(ckpt) as mgr:
            mgr.restore(zeroed(v1), step=2)
    except CorruptCheckpointError as e:
        msg = str(e)
        check("flipped shared byte, step=2: raises on every rank", "step 2" in msg and "checksum" in msg, msg)
    except Exception as e:
        check("flipped shared byte, step=2: raises on every rank", False, f"{type(e).__name__}: {e}")
    else:
        check("flipped shared byte, step=2: raises on every rank", False, "restored")
    target = zeroed(v1)  # the newest last: its fallback quarantines step 2
    with CheckpointManager(ckpt) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = mgr.restore(target)
    check("flipped shared byte: every rank falls back to step 1", got == 1, f"restored {got}")
    check("flipped shared byte: fallback warns", any("step 2" in str(w.message) for w in caught), str(caught))
    check("flipped shared byte: step 1 bit for bit", not same_bits(target, v1, list(SHAPES)), "")


def partial_on_one_rank(ckpt: Path, rank: int) -> None:
    """Rank 0 restores ``mid`` alone, the others everything: only some ranks share a range."""
    v1 = placed(full_values(4), 4)
    target = zeroed(v1)
    only = ["mid"] if rank == 0 else None
    with CheckpointManager(ckpt) as mgr:
        mgr.restore(target, step=1, only=only)
    keys = ["mid"] if rank == 0 else list(SHAPES)
    check("partial on one rank: restored keys bit for bit", not same_bits(target, v1, keys), "")
    rest = [k for k in SHAPES if k not in keys]
    check("partial on one rank: the others untouched", all(not local(target[k]).any() for k in rest), rest)


def owner_read_fails(ckpt: Path, rank: int) -> None:
    """Rank 0 owns the first shared piece (owners go to the least loaded, lowest rank first).
    Its read failing once: the ranks that need the piece read it themselves, and rank 0 again
    in its own fill: all restore. Failing always: rank 0 raises its storage error naming the
    step, its rank and the file; the others hear of it; none hangs."""
    v1 = placed(full_values(4), 4)
    local = LocalStorage(ckpt)
    hits: list[str] = []

    def fault(op: str, path: str) -> OSError:
        hits.append(path)
        return OSError(errno.EIO, "injected fault")

    once = FaultyStorage(local, fail_on={"read_into": "*/data/*"}, times=1, error=fault) if rank == 0 else local
    target = zeroed(v1)
    with CheckpointManager(once, retry_max_attempts=1) as mgr:
        got = mgr.restore(target, step=1)
    check("owner read fails once: every rank restores", got == 1 and not same_bits(target, v1, list(SHAPES)), "")
    check("owner read fails once: the fault was hit", rank != 0 or len(hits) == 1, hits)
    always = FaultyStorage(local, fail_on={"read_into": "*/data/*"}) if rank == 0 else local
    name = "owner read fails always: every rank raises"
    try:
        with CheckpointManager(always, retry_max_attempts=1) as mgr:
            mgr.restore(zeroed(v1), step=1)
    except StorageError as e:
        msg = str(e)
        check(name, rank == 0 and "step 1" in msg and "rank 0" in msg and "/data/" in msg, msg)
    except CheckpointRestoreError as e:
        check(name, rank != 0 and "another rank" in str(e), str(e))
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")
    else:
        check(name, False, "restored")


if __name__ == "__main__":
    main()
