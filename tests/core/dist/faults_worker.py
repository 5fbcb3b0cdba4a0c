"""Multi-process fault-injection worker (run under torchrun with 3 ranks).

    faults_worker.py ROOT

Every check runs on every rank; each rank writes ``ROOT/results/faults-r<R>.json``. Faults
come from ``FaultyStorage`` wrapping the real local storage, configured per check: a write
that fails on one named rank, a commit that fails, a rank that hangs past the commit timeout,
a flipped byte on disk. After each failure the next save must commit as usual.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build, full_state, train_step  # noqa: E402

from shardkeeper.core import (  # noqa: E402
    CheckpointManager,
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    ChecksumMismatchError,
    StorageError,
)
from shardkeeper.core.storage import LocalStorage  # noqa: E402
from shardkeeper.core.testing.faults import FaultyStorage  # noqa: E402
from tests.checks import Checks, state_diff  # noqa: E402

checks = Checks()
check = checks.check


def expect_save_error(name: str, mgr: CheckpointManager, step: int, state: dict, *needles: str, kind: type = CheckpointSaveError) -> None:
    try:
        mgr.save(step, state).wait()
    except kind as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        check(name, not missing, f"message lacks {missing}: {msg}")
    except Exception as e:  # the wrong error type
        check(name, False, f"{type(e).__name__}: {e}")
    else:
        check(name, False, "save succeeded")
    dist.barrier()
    manifest = Path(mgr.storage.describe(f"step-{step:012d}/manifest.json"))
    check(f"{name}: no manifest", not manifest.exists(), f"{manifest} exists")


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    checks.guard("whole run", lambda: run(root, rank))
    checks.write(root / "results" / f"faults-r{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def run(root: Path, rank: int) -> None:
    model, opt = build("fsdp2", seed=1)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    local = LocalStorage(root / "ckpt")

    # 1. A write that fails on rank 1 only: every rank's wait() raises, naming rank 1.
    faulty = FaultyStorage(local, fail_on={"open_writer": "*/data/r00001-*"})
    with CheckpointManager(faulty) as mgr:
        expect_save_error("write fails on rank 1", mgr, 1, state, "rank 1", "write", "step 1")

    # 2. The commit itself fails: every rank hears of it, phase commit.
    faulty = FaultyStorage(local, fail_on={"put_if_absent": "*/manifest.json"})
    with CheckpointManager(faulty) as mgr:
        expect_save_error("commit fails", mgr, 2, state, "rank 0", "commit", "step 2")

    # 3. Rank 2 hangs in its write past the commit timeout: a timeout error everywhere.
    def slow(op: str, path: str) -> Exception:
        time.sleep(4.0)
        return OSError(5, "injected after a stall")

    faulty = FaultyStorage(local, fail_on={"open_writer": "*/data/r00002-*"}, error=slow)
    with CheckpointManager(faulty, commit_timeout_s=1.5) as mgr:
        expect_save_error("rank 2 hangs", mgr, 3, state, "step 3", "rank", kind=Exception)

    # 4. After all that, saves commit; the async race holds under FSDP2.
    with CheckpointManager(local, keep_last=3) as mgr:
        ref5 = full_state(model, opt)
        h = mgr.save(5, state)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # mutate right after save() returns
        h.wait()
        check("steps after failures", mgr.steps() == [5], f"steps {mgr.steps()}")
        restored_model, restored_opt = build("fsdp2", seed=3)
        mgr.restore({"model": restored_model, "optim": restored_opt}, step=5)
        checks.same("async race: the checkpoint holds the pre-save values",
                    full_state(restored_model, restored_opt), ref5)

        train_step(model, opt, 1)
        mgr.save(7, state).wait()
        ref7 = full_state(model, opt)
        dist.barrier()

        # 5. A flipped byte in step 7: restoring step 7 fails everywhere; "latest" falls back.
        if rank == 0:
            man = json.loads((root / "ckpt/step-000000000007/manifest.json").read_text())
            chunk = man["leaves"]["model/fc1.weight"]["chunks"][0]
            path = root / "ckpt/step-000000000007" / chunk["file"]
            with open(path, "r+b") as f:
                f.seek(chunk["offset"] + 5)
                b = f.read(1)
                f.seek(chunk["offset"] + 5)
                f.write(bytes([b[0] ^ 0xFF]))
        dist.barrier()
        target_model, target_opt = build("fsdp2", seed=4)
        target = {"model": target_model, "optim": target_opt}
        try:
            mgr.restore(target, step=7)
            check("explicit damaged step raises", False, "restore succeeded")
        except ChecksumMismatchError as e:
            check("checksum error names key and file", "model/fc1.weight" in str(e) and ".safetensors" in str(e), str(e))
        except CheckpointRestoreError as e:
            check("other ranks hear of the damage", "step 7" in str(e), str(e))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            step = mgr.restore(target)
        check("latest falls back to step 5", step == 5, f"restored {step}")
        check("fallback warns", any("falling back" in str(x.message) for x in w), [str(x.message) for x in w].__repr__())
        checks.same("fallback restored step 5 bit for bit", full_state(target_model, target_opt), ref5)
        check("ref7 differs from ref5 (control)", state_diff(ref7, ref5), "no difference")

        # 5b. A damaged newest manifest (step 8): every rank falls back past it and past the
        # damaged step 7, together, to step 5.
        train_step(model, opt, 2)
        mgr.save(8, state).wait()
        dist.barrier()
        if rank == 0:
            (root / "ckpt/step-000000000008/manifest.json").write_bytes(b'{"format_version": 5, "step": 8, ')
        dist.barrier()
        fb_model, fb_opt = build("fsdp2", seed=6)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            step = mgr.restore({"model": fb_model, "optim": fb_opt})
        check("damaged newest manifest: falls back to step 5", step == 5, f"restored {step}")
        check("damaged newest manifest: warns naming step 8",
              any("step 8" in str(x.message) and "falling back" in str(x.message) for x in w),
              [str(x.message) for x in w].__repr__())
        checks.same("damaged newest manifest: step 5 bit for bit", full_state(fb_model, fb_opt), ref5)

    # 5c. The storage fails on rank 1 only while reading step 5's data (its retries spent):
    # past the damaged steps 8 and 7, every rank raises at step 5 instead of going on to an
    # older step (step 1, 2, 3 never committed: none; the check is that nothing is restored).
    broken = FaultyStorage(local, fail_on={"read_into": "*step-000000000005/data/*"}) if rank == 1 else local
    with CheckpointManager(broken, retry_max_attempts=1) as mgr:
        sf_model, sf_opt = build("fsdp2", seed=7)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the falls back past steps 8 and 7 (damaged)
                step = mgr.restore({"model": sf_model, "optim": sf_opt})
            check("storage failure on rank 1 is raised everywhere", False, f"restored {step}")
        except CheckpointRestoreError as e:
            check("storage failure on rank 1 is raised everywhere", rank != 1 and "another rank" in str(e), str(e))
        except StorageError as e:
            check("storage failure on rank 1 is raised everywhere", rank == 1 and "step 5" in str(e) and "rank 1" in str(e), str(e))
        except Exception as e:
            check("storage failure on rank 1 is raised everywhere", False, f"{type(e).__name__}: {e}")

    with CheckpointManager(local, keep_last=3) as mgr:
        # 6. Partial restore reads only what it needs.
        part_model, part_opt = build("fsdp2", seed=5)
        before = {k: v.clone() for k, v in full_state(part_model, part_opt).items()}
        mgr.restore({"model": part_model, "optim": part_opt}, step=5, only=["model/fc1.*"])
        st = mgr.last_restore_stats
        after = full_state(part_model, part_opt)
        changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
        check("partial restore changes exactly the selected keys", changed == ["model/fc1.bias", "model/fc1.weight"], str(changed))
        checks.same("partial restore restored them exactly",
                    {k: after[k] for k in changed}, {k: ref5[k] for k in changed})
        check("partial restore reads at most 5% more than needed", st is not None and st.bytes_read <= 1.05 * st.bytes_needed and st.bytes_needed > 0, str(st))


if __name__ == "__main__":
    main()
