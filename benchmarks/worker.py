"""Per-rank measurements; launched by run.py under ``torchrun --standalone``.

    torchrun --standalone --nproc-per-node 2 benchmarks/worker.py --state fsdp --size-mib 64 \\
        --dir WORK/a-64 --out WORK/results/a-64 --phases save,restore --save-label a-64 \\
        --restore-label a-64 --partial-label d-64 --repeats 3

One launch builds one state and runs

- the save phase: a warm-up round, then ``--repeats`` rounds; every round runs every save
  method once, in an order rotated by one each round so that drift hits all methods alike.
  Each round writes under its own directory (``rep<r>/``; a new step for shardkeeper).
- the restore phase: the save side is freed first (and the heap trimmed); RSS is read; a
  target state with other values is built; then a warm-up round and ``--repeats`` rounds of
  restores, each reading the files of its own save round. Before every cold measurement every
  file under ``--dir`` is fsync'ed and dropped from the page cache (POSIX_FADV_DONTNEED), so
  reads come from the disk; a warm-cache measurement follows right after (``--warm``).

Every rank writes its samples to ``<out>/rank<k>.json``; run.py combines the ranks (times: max
over ranks; bytes and CPU seconds: sum; RSS ratio: max).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
import _proc  # noqa: E402
from states import FsdpState, SmallState  # noqa: E402

from shardkeeper.core import CheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")  # DCP and FSDP warn about experimental APIs on every call

SAVE_METHODS = [
    "raw_copy",
    "raw_write",
    "torch_save",
    "dcp_save",
    "dcp_async",
    "dcp_async_reuse",
    "sk_async",
    "sk_sync",
    "digest",
]
RESTORE_METHODS = ["raw_read", "torch_load", "dcp_load", "sk_restore"]
PARTIAL_METHODS = ["dcp_partial", "sk_partial"]
DIGEST_BLOCK = 1 << 20
ASYNC_STEP_BASE = 100_000
WARMUP = -1


def rotated(methods: list[str], r: int) -> list[str]:
    k = r % len(methods) if methods else 0
    return methods[k:] + methods[:k]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rep_name(r: int) -> str:
    return "rep-warmup" if r == WARMUP else f"rep{r}"


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous()
        h.update(k.encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.dir)
        self.samples: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {"rank": rank(), "world": world()}
        self.st: Any = None

    # -- helpers -------------------------------------------------------------------------------
    def build(self, seed: int) -> Any:
        if self.args.state == "fsdp":
            return FsdpState.build(self.args.size_mib, world_save=self.args.world_save, seed=seed)
        return SmallState.build(self.args.n_tensors, seed=seed)

    def record(self, **kw: Any) -> None:
        if kw.get("rep") != WARMUP:
            self.samples.append({"rank": rank(), **kw})

    def dump(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"rank{rank()}.json.tmp"
        tmp.write_text(json.dumps({"info": self.info, "samples": self.samples}, indent=1))
        tmp.replace(out / f"rank{rank()}.json")

    def rm(self, path: Path) -> None:
        """Delete ``path`` on rank 0, once every rank is done with it."""
        barrier()
        if rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        barrier()

    def rm_step(self, step: int) -> None:
        """Delete a shardkeeper step directory (rank 0, once every rank is done with it)."""
        barrier()
        if rank() == 0:
            p = self.sk_step_dir(step)
            if p is not None:
                shutil.rmtree(p, ignore_errors=True)
        barrier()

    def sk_step_dir(self, step: int) -> Path | None:
        for p in (self.dir / "sk").glob("step-*"):
            if p.name.split("-", 1)[1].isdigit() and int(p.name.split("-", 1)[1]) == step:
                return p
        return None

    def raw_path(self) -> Path:
        return self.dir / "raw" / f"rank{rank()}.bin"

    # -- save phase ----------------------------------------------------------------------------
    def save_phase(self) -> None:
        a = self.args
        st = self.st = self.build(seed=0)
        local = st.local_tensors()
        nbytes = sum(t.nbytes for t in local.values())
        self.info.update(st.info, state_bytes=nbytes, n_local_tensors=len(local))
        self.info["fingerprint_saved"] = fingerprint(local)
        # The raw anchors' one buffer, preallocated and touched once (reused every round).
        raw = torch.empty(nbytes, dtype=torch.uint8)
        raw.fill_(0)
        views = []
        off = 0
        for t in local.values():
            views.append((raw[off : off + t.nbytes].view(t.dtype).view(t.shape), t))
            off += t.nbytes
        (self.dir / "raw").mkdir(parents=True, exist_ok=True)

        from _dcp_stager import ReusableStager
        from torch.distributed.checkpoint.staging import StagingOptions

        # DCP's reused stager: created once, handed to every async_save (torch 2.13 API). On CPU
        # pinned/shared memory and non-blocking copies are unavailable; staging is synchronous.
        reuse = ReusableStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )
        mgr = CheckpointManager(self.dir / "sk")
        self.info["sk_options"] = {k: v for k, v in mgr.options.__dict__.items()}

        def run_method(m: str, r: int) -> dict[str, Any]:
            rep = self.dir / rep_name(r)
            if m == "raw_copy":
                t0 = time.perf_counter()
                for dst, src in views:
                    dst.copy_(src)
                dt = time.perf_counter() - t0
                return {"stall_s": dt, "committed_s": dt}
            if m == "digest":
                mv = memoryview(raw.numpy())
                t0 = time.perf_counter()
                for b in range(0, nbytes, DIGEST_BLOCK):
                    xxhash.xxh3_128_hexdigest(mv[b : b + DIGEST_BLOCK])
                dt = time.perf_counter() - t0
                return {"wall_s": dt}
            if m == "raw_write":
                path = self.raw_path()
                path.unlink(missing_ok=True)
                mv = memoryview(raw.numpy())
                t0 = time.perf_counter()
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    pos = 0
                    while pos < nbytes:
                        pos += os.write(fd, mv[pos : pos + (1 << 30)])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                dt = time.perf_counter() - t0
                return {"stall_s": dt, "committed_s": dt, "bytes_written": nbytes}
            if m == "torch_save":
                path = rep / "torch" / f"rank{rank()}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                payload = st.torch_payload()
                with open(path, "wb") as f:
                    torch.save(payload, f)
                    f.flush()
                    os.fsync(f.fileno())
                dt = time.perf_counter() - t0
                return {"stall_s": dt, "committed_s": dt, "bytes_written": path.stat().st_size}
            if m in ("dcp_save", "dcp_async", "dcp_async_reuse"):
                path = rep / m.replace("_save", "")
                t0 = time.perf_counter()
                sd = self.dcp_sd(st)
                if m == "dcp_save":
                    dcp.save(sd, checkpoint_id=str(path))
                    dt = time.perf_counter() - t0
                    return {"stall_s": dt, "committed_s": dt}
                fut = dcp.async_save(
                    sd, checkpoint_id=str(path), async_stager=reuse if m == "dcp_async_reuse" else None
                )
                stall = time.perf_counter() - t0
                fut.result()
                return {"stall_s": stall, "committed_s": time.perf_counter() - t0, "_rm": path}
            if m == "sk_async":
                step = ASYNC_STEP_BASE + r
                t0 = time.perf_counter()
                h = mgr.save(step, st.sk_state())
                stall = time.perf_counter() - t0
                h.wait()
                return {
                    "stall_s": stall,
                    "committed_s": time.perf_counter() - t0,
                    "sk_stall_s": h.stall_s,
                    "_rm_step": step,
                }
            if m == "sk_sync":
                step = r if r != WARMUP else ASYNC_STEP_BASE - 1
                t0 = time.perf_counter()
                mgr.save(step, st.sk_state(), async_save=False)
                dt = time.perf_counter() - t0
                return {"stall_s": dt, "committed_s": dt}
            raise ValueError(m)

        methods = [m for m in SAVE_METHODS if m in a.save_methods]
        for r in [*([WARMUP] if a.warmup else []), *range(a.repeats)]:
            for m in rotated(methods, max(r, 0)):
                gc.collect()
                barrier()
                c0, u0 = _proc.cpu_s(), _proc.usage()
                res = run_method(m, r)
                cpu = _proc.cpu_s() - c0
                res.update(_proc.usage_delta(u0))
                rm, rm_step = res.pop("_rm", None), res.pop("_rm_step", None)
                self.record(phase="save", case=a.save_label, method=m, rep=r, cpu_s=cpu, state_bytes=nbytes, **res)
                if rm is not None:
                    self.rm(rm)
                if rm_step is not None:
                    self.rm_step(rm_step)
            if r == WARMUP:
                self.rm(self.dir / rep_name(WARMUP))
                self.rm_step(ASYNC_STEP_BASE - 1)
            barrier()
        # on-disk size of what each method wrote (rank 0, the whole job)
        if rank() == 0:
            sizes = {
                "torch": _proc.tree_bytes(self.dir / "rep0" / "torch"),
                "dcp": _proc.tree_bytes(self.dir / "rep0" / "dcp"),
            }
            p = self.sk_step_dir(0)
            sizes["sk"] = _proc.tree_bytes(p) if p else 0
            self.info["bytes_on_disk_rep0"] = sizes
        mgr.close()
        reuse.close_now()
        # free the save side before the restore phase measures RSS (run_method's cells too)
        views.clear()
        local.clear()
        mgr = reuse = raw = None  # type: ignore[assignment]
        self.st = st = None
        gc.collect()
        _proc.malloc_trim()
        barrier()

    def dcp_sd(self, st: Any) -> dict[str, Any]:
        if isinstance(st, FsdpState):
            msd, osd = st.dcp_state_dicts()
            return {"model": msd, "optim": osd}
        return {"state": st.tensors}

    # -- restore phase -------------------------------------------------------------------------
    def restore_phase(self) -> None:
        a = self.args
        if self.st is None and "save" not in a.phases:
            # A fresh process: build a tiny state first, so that what the first build of a state
            # imports and caches (FSDP, DTensor, AdamW) is not counted as the target's memory.
            tiny = FsdpState.build(1, world_save=a.world_save) if a.state == "fsdp" else SmallState.build(10)
            del tiny
        gc.collect()
        _proc.malloc_trim()
        rss_before_target = _proc.rss_bytes()
        st = self.st = self.build(seed=1)  # other values than the saved state
        local = st.local_tensors()
        nbytes = sum(t.nbytes for t in local.values())
        gc.collect()
        _proc.malloc_trim()
        rss_after_target = _proc.rss_bytes()
        partial_bytes = st.partial_bytes() if isinstance(st, FsdpState) else 0
        self.info.update(
            st.info,
            restore_state_bytes=nbytes,
            rss_before_target=rss_before_target,
            rss_after_target=rss_after_target,
            partial_bytes=partial_bytes,
            hwm_reset_ok=_proc.reset_hwm(),
        )
        saved_fp = self.info.get("fingerprint_saved")
        mgr = CheckpointManager(self.dir / "sk")
        raw = None
        if "raw_read" in a.restore_methods:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            raw.fill_(0)

        def run_method(m: str, r: int) -> dict[str, Any]:
            rep = self.dir / rep_name(max(r, 0))  # the warm-up round reads round 0's files
            if m == "raw_read":
                assert raw is not None
                mv = memoryview(raw.numpy())
                t0 = time.perf_counter()
                with open(self.raw_path(), "rb", buffering=0) as f:
                    pos = 0
                    while pos < nbytes:
                        n = f.readinto(mv[pos : pos + (1 << 30)])
                        if not n:
                            break
                        pos += n
                return {"wall_s": time.perf_counter() - t0, "bytes_needed": nbytes}
            if m == "torch_load":
                t0 = time.perf_counter()
                loaded = torch.load(rep / "torch" / f"rank{rank()}.pt", map_location="cpu", weights_only=True)
                st.torch_apply(loaded)
                del loaded
                return {"wall_s": time.perf_counter() - t0, "bytes_needed": nbytes}
            if m == "dcp_load":
                t0 = time.perf_counter()
                sd = self.dcp_sd(st)
                dcp.load(sd, checkpoint_id=str(rep / "dcp"))
                if isinstance(st, FsdpState):
                    st.dcp_set(sd["model"], sd["optim"])
                return {"wall_s": time.perf_counter() - t0, "bytes_needed": nbytes}
            if m == "sk_restore":
                t0 = time.perf_counter()
                mgr.restore(st.sk_state(), step=max(r, 0))
                dt = time.perf_counter() - t0
                s = mgr.last_restore_stats
                return {
                    "wall_s": dt,
                    "bytes_needed": nbytes,
                    "sk_bytes_read": s.bytes_read,
                    "sk_bytes_needed": s.bytes_needed,
                    "sk_reads": s.reads,
                }
            if m == "dcp_partial":
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    get_model_state_dict,
                    set_model_state_dict,
                )

                t0 = time.perf_counter()
                msd = get_model_state_dict(st.model)
                sub = {k: v for k, v in msd.items() if k.startswith(st.layer_prefix())}
                dcp.load({"model": sub}, checkpoint_id=str(rep / "dcp"))
                set_model_state_dict(st.model, sub, options=StateDictOptions(strict=False))
                return {"wall_s": time.perf_counter() - t0, "bytes_needed": partial_bytes}
            if m == "sk_partial":
                t0 = time.perf_counter()
                mgr.restore(st.sk_state(), step=max(r, 0), only=[f"model/{st.layer_prefix()}*"])
                dt = time.perf_counter() - t0
                s = mgr.last_restore_stats
                return {
                    "wall_s": dt,
                    "bytes_needed": partial_bytes,
                    "sk_bytes_read": s.bytes_read,
                    "sk_bytes_needed": s.bytes_needed,
                    "sk_reads": s.reads,
                }
            raise ValueError(m)

        full = [m for m in RESTORE_METHODS if m in a.restore_methods]
        partial = PARTIAL_METHODS if a.partial_label else []
        plan = [(m, a.restore_label) for m in full] + [(m, a.partial_label) for m in partial]
        for r in [*([WARMUP] if a.warmup else []), *range(a.repeats)]:
            for i in range(len(plan)):
                m, label = plan[(i + max(r, 0)) % len(plan)]
                for cache in ("cold", "warm") if (a.warm and m in full) else ("cold",):
                    check = cache == "cold" and m in full and m != "raw_read" and saved_fp is not None and r != WARMUP
                    if check:  # so that a restore that restored nothing cannot pass
                        with torch.no_grad():
                            for t in st.local_tensors().values():
                                t.zero_()
                    gc.collect()
                    _proc.malloc_trim()
                    if cache == "cold":
                        barrier()
                        if rank() == 0:
                            _proc.evict(self.dir)
                    barrier()
                    rss_pre = _proc.rss_bytes()
                    _proc.reset_hwm()
                    r0, c0, u0 = _proc.rchar(), _proc.cpu_s(), _proc.usage()
                    res = run_method(m, WARMUP if r == WARMUP else r)
                    cpu, rch = _proc.cpu_s() - c0, _proc.rchar() - r0
                    res.update(_proc.usage_delta(u0))
                    hwm = _proc.hwm_bytes()
                    sample = dict(
                        phase="restore",
                        case=label,
                        method=m,
                        rep=r,
                        cache=cache,
                        cpu_s=cpu,
                        bytes_read=rch,
                        state_bytes=nbytes,
                        rss_pre=rss_pre,
                        hwm=hwm,
                        rss_before_target=rss_before_target,
                        rss_after_target=rss_after_target,
                        **res,
                    )
                    if cache == "cold":
                        # (VmHWM - RSS before the target state was allocated) / state size, as
                        # (the target's own RSS + what the restore added on top) / state size:
                        # so that neither the raw-read anchor's buffer nor anything left over
                        # from an earlier measurement counts.
                        extra = hwm - rss_pre
                        sample["extra_rss_ratio"] = extra / nbytes
                        sample["peak_rss_ratio"] = (rss_after_target - rss_before_target + extra) / nbytes
                    if check:
                        sample["verified"] = fingerprint(st.local_tensors()) == saved_fp
                    self.record(**sample)
                    if r == WARMUP and cache == "cold":
                        break
            barrier()
        mgr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", choices=["fsdp", "small"], required=True)
    ap.add_argument("--size-mib", type=float, default=256)
    ap.add_argument("--world-save", type=int, default=2, help="world size the fsdp state is sized for")
    ap.add_argument("--n-tensors", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", required=True, help="this case's checkpoint directory")
    ap.add_argument("--out", required=True, help="where rank<k>.json goes")
    ap.add_argument("--phases", default="save,restore")
    ap.add_argument("--save-label", default="")
    ap.add_argument("--restore-label", default="")
    ap.add_argument("--partial-label", default="", help="also run the partial restores under this label")
    ap.add_argument("--save-methods", default=",".join(SAVE_METHODS))
    ap.add_argument("--restore-methods", default=",".join(RESTORE_METHODS))
    ap.add_argument("--warm", action="store_true", help="also measure each full restore with a warm page cache")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up rounds")
    args = ap.parse_args()
    args.save_methods = args.save_methods.split(",")
    args.restore_methods = args.restore_methods.split(",")
    args.phases = args.phases.split(",")
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    b = Bench(args)
    phases = args.phases
    import shardkeeper.core

    b.info["start_time"] = time.time()
    b.info["shardkeeper_core_file"] = shardkeeper.core.__file__
    try:
        if "save" in phases:
            b.save_phase()
            b.dump()
        if "restore" in phases:
            b.restore_phase()
        b.info["end_time"] = time.time()
        b.dump()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Results are written and process groups destroyed. Leave without the interpreter's C++
    # teardown, where a gloo thread still joinable aborts about one launch in forty
    # (tests/worker_main.py does the same for the test workers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
