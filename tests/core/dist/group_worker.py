"""Group commit on a real process group (tests/core/commit/test_group_commit.py).

    group_worker.py ROOT OUT_DIR

At 4 ranks with ``commit_group_ranks=2``: rank 0 is a group of its own, rank 1 leads ranks 1
and 2, rank 3 itself; each leader folds its group's reports and writes its page; the manifest (requiring pages) lists the pages instead of the
ranks' files. A state of described DTensors plus a replicated tensor is saved and restored
into the same layout, another one and plain tensors, bit for bit, reading only the pages it
needs; verify and gc; incremental saves and retention; an encrypted root; a damaged page;
a rank whose state differs, named through its leader's folded report; a file lost before
its leader checks it; the coordinator's page not written; a rank that never reports; ranks passing different group sizes.
Each rank writes what it saw to ``OUT_DIR/r<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from described_worker import full, gathered, layout_a, layout_b, same
from seen import finish

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import StorageError
from shardkeeper.core.lifecycle.gc import collect_garbage
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step


def _error(fn) -> str | None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(e).__name__}: {e}"
    return None


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    seen: dict[str, object] = {"rank": rank}
    ref = full()
    path = Path(root) / "group"
    with CheckpointManager(path, describe_layouts=True, commit_group_ranks=2) as mgr:
        mgr.save(1, {"m": layout_a(w)}).wait()
        mgr.save(2, {"m": layout_a(w)}).wait()  # a second save: the store keys of the first are gone
        man = json.loads((path / "step-000000000001" / "manifest.json").read_text())
        seen["version"] = [man["format_version"], man.get("requires", [])]
        seen["pages"] = man["described"].get("pages")
        seen["index entries"] = man["described"]["index"]["path"]
        seen["files"] = sorted(man["files"])
        for tname, target in (
            ("same", layout_a(w)),
            ("other", layout_b(w)),
            ("plain", {k: torch.zeros_like(v) for k, v in ref.items()}),
        ):
            for v in target.values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
            state = {"m": target}
            mgr.restore(state, step=1)
            seen[f"{tname} wrong"] = same(gathered(state["m"]), ref)
            seen[f"{tname} pages read"] = mgr.last_restore_stats.pages
        dist.barrier()
        if rank == 0:
            storage = LocalStorage(str(path))
            seen["verify"] = [p.message for p in verify_step(storage, 1).problems]
            seen["gc removed"] = collect_garbage(storage, min_age_s=0.0, no_running_saves=True).removed_paths
        dist.barrier()
        state = {"m": {k: torch.zeros_like(v) for k, v in ref.items()}}
        mgr.restore(state, step=1)
        seen["after gc wrong"] = same(state["m"], ref)
        # A rank whose state differs: the coordinator names it through its leader's report.
        odd = layout_a(w)
        if rank == 2:
            odd["extra"] = torch.ones(2)
        seen["mismatch"] = _error(lambda: mgr.save(3, {"m": odd}, async_save=False))
        # A replicated copy one ulp off on rank 2: its leader folds the copies' sums, and the
        # coordinator still names the tensor and rank 2.
        off = layout_a(w)
        if rank == 2:
            off["plain"] = off["plain"].clone()
            off["plain"].view(-1)[0] = torch.nextafter(off["plain"].view(-1)[0], torch.tensor(float("inf")))
        seen["replica off"] = _error(lambda: mgr.save(3, {"m": off}, async_save=False))
        # A file removed before its leader checks it (as by a gc with a too short --min-age-s):
        # the leader's failure reaches every rank, naming the file's rank.
        if rank == 1:
            import shardkeeper.core.save.group as group_fold

            real = group_fold.check_files

            def losing(storage, own, ends, executor=None):  # type: ignore[no-untyped-def]
                for p in own:
                    if "/r00002-" in p and p.endswith(".safetensors"):
                        storage.delete(p)
                return real(storage, own, ends, executor)

            group_fold.check_files = losing
        seen["lost file"] = _error(lambda: mgr.save(4, {"m": layout_a(w)}, async_save=False))
        if rank == 1:
            group_fold.check_files = real
        seen["step 4 committed"] = (path / "step-000000000004" / "manifest.json").exists()
        # The coordinator's own page, synced while it merges the leaders' reports, cannot be
        # written: the save fails on every rank with that error, and on rank 0 returns only
        # once the write has ended (nothing of a failed save is still being written).
        if rank == 0:
            import shardkeeper.core.save.group as group_fold

            real_write, ended = group_fold.write_durably, []

            def failing(*args):  # type: ignore[no-untyped-def]
                time.sleep(0.5)  # (longer than the merge: the commit waits for it)
                ended.append(args[2])
                raise StorageError("injected: the page could not be synced")

            group_fold.write_durably = failing
        seen["page lost"] = _error(lambda: mgr.save(5, {"m": layout_a(w)}, async_save=False))
        if rank == 0:
            seen["page write ended first"] = len(ended) == 1 and ended[0].startswith("pages/g00000-")
            group_fold.write_durably = real_write
        seen["step 5 committed"] = (path / "step-000000000005" / "manifest.json").exists()
    # Incremental: unchanged boxes are references into step 1's files, listed in the pages;
    # retention keeping one step keeps the files step 2's pages reference.
    inc = Path(root) / "inc"
    with CheckpointManager(inc, describe_layouts=True, incremental=True, commit_group_ranks=2, keep_last=1) as mgr:
        state = {"m": layout_a(w)}
        mgr.save(1, state, async_save=False)
        state["m"]["rows"].to_local().add_(1.0)
        mgr.save(2, state, async_save=False)
        man = json.loads((inc / "step-000000000002" / "manifest.json").read_text())
        refs = []
        for rel in man["described"]["pages"]["path"]:
            page = json.loads((inc / "step-000000000002" / rel).read_text())
            refs += [p for p in page["chunk_files"]["path"] if p.startswith("../")]
        seen["inc references"] = refs
        seen["inc step 1 manifest"] = (inc / "step-000000000001" / "manifest.json").exists()
        target = {"m": {k: torch.zeros_like(v) for k, v in ref.items()}}
        mgr.restore(target, step=2)
        seen["inc wrong"] = same(target["m"], {**ref, "rows": ref["rows"] + 1.0})
    dist.barrier()
    if rank == 0:
        seen["inc verify"] = [p.message for p in verify_step(LocalStorage(str(inc)), 2).problems]
    # Encrypted: the data files are, the pages are not (the manifest's digests, under its MAC,
    # authenticate them), so that gc and verify without the key read them too.
    enc = Path(root) / "enc"
    with CheckpointManager(enc, describe_layouts=True, commit_group_ranks=2, encryption="env:SK_GROUP_KEY") as mgr:
        mgr.save(1, {"m": layout_a(w)}, async_save=False)
        man = json.loads((enc / "step-000000000001" / "manifest.json").read_text())
        seen["enc pages"] = len(man["described"]["pages"]["path"])
        seen["enc page plain"] = [
            (enc / "step-000000000001" / rel).read_bytes()[:1] == b"{" for rel in man["described"]["pages"]["path"]
        ]
        target = {"m": layout_b(w)}
        for v in target["m"].values():
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
        mgr.restore(target, step=1)
        seen["enc wrong"] = same(gathered(target["m"]), ref)
    dist.barrier()
    if rank == 0:
        from shardkeeper.core.codec.crypto import EncryptedStorage
        from shardkeeper.core.codec.keys import key_provider

        plain = LocalStorage(str(enc))
        seen["enc verify keyless"] = [p.message for p in verify_step(plain, 1).problems]
        keyed = EncryptedStorage(plain, key_provider("env:SK_GROUP_KEY")).authenticated()
        seen["enc verify"] = [p.message for p in verify_step(keyed, 1).problems]
        seen["enc gc"] = _error(lambda: collect_garbage(plain, min_age_s=0.0, dry_run=True, no_running_saves=True))
    # A damaged page: restores that need it refuse, naming it and its ranks; verify says so.
    dist.barrier()
    if rank == 0:
        (page,) = sorted((path / "step-000000000001" / "pages").glob("g00001-*.index.json"))
        text = page.read_text()
        page.write_text(text.replace('"size_bytes":', '"size_bytes": ', 1)[: len(text)])
    dist.barrier()
    with CheckpointManager(path, commit_group_ranks=2) as mgr:
        state = {"m": {k: torch.zeros_like(v) for k, v in ref.items()}}
        seen["damaged"] = _error(lambda: mgr.restore(state, step=1))
    if rank == 0:
        seen["damaged verify"] = [p.message for p in verify_step(LocalStorage(str(path)), 1).problems]
        # a file the intact page lists, made longer: still checked beside the damaged page
        (data,) = sorted((path / "step-000000000001" / "data").glob("r00003-*.safetensors"))
        with open(data, "ab") as f:
            f.write(b"x" * 100)
        seen["damaged verify 2"] = [p.message for p in verify_step(LocalStorage(str(path)), 1).problems]
    dist.barrier()
    # A step with a damaged page can still be deleted, and gc then runs.
    with CheckpointManager(path, commit_group_ranks=2) as mgr:
        seen["damaged deleted"] = mgr.delete(1)
    if rank == 0:
        seen["gc after"] = _error(lambda: collect_garbage(LocalStorage(str(path)), min_age_s=0.0, no_running_saves=True))
        seen["step 1 left"] = (path / "step-000000000001").exists()
    # A rank that never reports: its leader times out and names it; the coordinator, which
    # waits a little longer for the leaders, publishes the leader's failure to every rank.
    with CheckpointManager(Path(root) / "hang", commit_group_ranks=2, commit_timeout_s=3) as mgr:
        if rank != 2:
            seen["missing rank"] = _error(lambda: mgr.save(1, {"x": torch.ones(2)}, async_save=False))
    dist.barrier()
    # Ranks that pass different group sizes are refused when the manager opens.
    seen["differing sizes"] = _error(lambda: CheckpointManager(Path(root) / "x", commit_group_ranks=2 + rank % 2))
    finish(out, rank, seen)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
