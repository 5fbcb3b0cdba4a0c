"""Incremental checkpoints (``incremental=True``): unchanged chunks become references to the
file that holds them, on every backend; retention and gc keep exactly what is referenced;
restores stay bit for bit, also after the base step's manifest is gone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, ChecksumMismatchError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.lifecycle.retention import collect_garbage
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify.root import verify_root
from tests.checks import assert_same_state

pytestmark = pytest.mark.timeout(300)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "frozen.weight": torch.randn(256, 64, generator=g),
            "frozen.emb": torch.randn(128, 32, generator=g).to(torch.bfloat16),
            "head.weight": torch.randn(16, 64, generator=g),
        },
        "progress": {"step": 0},
    }


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "progress": {"step": -1},
    }


def _manifest(storage: Any, step: int) -> dict[str, Any]:
    return json.loads(storage.read_bytes(f"{step_dir(step)}/manifest.json"))


def _files(m: dict[str, Any], key: str) -> list[str]:
    return [c["file"] for c in m["leaves"][key]["chunks"]]


def test_unchanged_chunks_become_references_and_retention_keeps_them(storage_root) -> None:
    """Every backend: a reference instead of a rewrite; the base step deleted by retention
    while the later step references it still restores; a chain points at the holder; when
    nothing references the base's files any more, they go."""
    storage = storage_root.open()
    state = _state()
    with CheckpointManager(
        storage_root.url, storage_options=storage_root.options, keep_last=1, incremental=True
    ) as mgr:
        mgr.save(1, state).wait()
        base = _manifest(storage, 1)
        base_file = _files(base, "model/frozen.weight")[0]
        assert base_file.startswith("data/")

        state["model"]["head.weight"].add_(1.0)
        state["progress"]["step"] = 2
        mgr.save(2, state)  # async: the previous manifest is read on the writer's thread
        mgr.wait()
        m2 = _manifest(storage, 2)
        assert _files(m2, "model/frozen.weight") == [f"../{step_dir(1)}/{base_file}"]
        assert _files(m2, "model/frozen.emb")[0].startswith(f"../{step_dir(1)}/")
        assert _files(m2, "model/head.weight")[0].startswith("data/")
        written = sum(f["size_bytes"] for f in m2["files"].values())
        assert written < 16 * 64 * 4 + 1024, written  # only head.weight (+ header) was written
        # keep_last=1: step 1's manifest is gone, the file step 2 references is not.
        assert mgr.steps() == [2]
        assert storage.exists(f"{step_dir(1)}/{base_file}")
        assert verify_root(storage).ok

        # Step 3, nothing changed: the chain still points at the holder (step 1), never at 2.
        state["progress"]["step"] = 3
        mgr.save(3, state).wait()
        m3 = _manifest(storage, 3)
        assert _files(m3, "model/frozen.weight") == [f"../{step_dir(1)}/{base_file}"]
        assert _files(m3, "model/head.weight")[0].startswith(f"../{step_dir(2)}/")
        assert m3["files"] == {}  # every chunk a reference: no file written at all

        target = _empty_like(state)
        assert mgr.restore(target) == 3
        assert_same_state(target["model"], state["model"], what="the model")
        assert target["progress"]["step"] == 3
        partial = _empty_like(state)
        mgr.restore(partial, only="model/frozen.*")
        assert torch.equal(partial["model"]["frozen.emb"], state["model"]["frozen.emb"])
        assert not partial["model"]["head.weight"].any()

        # Everything changes: step 4 references nothing; retention now frees steps 1 and 2.
        for t in state["model"].values():
            t.add_(1)
        mgr.save(4, state).wait()
        assert all(
            c["file"].startswith("data/")
            for leaf in _manifest(storage, 4)["leaves"].values()
            for c in leaf.get("chunks", [])
        )
    # Retention deleted step 3; the tombstone files of steps 1 and 2 are referenced by no
    # committed manifest now: ordinary garbage, which gc removes (D4).
    assert storage.exists(f"{step_dir(1)}/{base_file}")
    collect_garbage(storage, min_age_s=0.0)
    assert not storage.exists(f"{step_dir(1)}/{base_file}")
    assert not storage.list_dir(step_dir(1)) and not storage.list_dir(step_dir(2))
    assert verify_root(storage).ok


def test_gc_keeps_files_a_retained_step_references(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
        storage = mgr.storage
        base_file = _files(_manifest(storage, 1), "model/frozen.weight")[0]
        # Step 1's manifest disappears (an operator, another tool): its directory is
        # uncommitted garbage to gc, except the file step 2 references.
        storage.delete(f"{step_dir(1)}/manifest.json")
        report = collect_garbage(storage, min_age_s=0.0)
        assert storage.exists(f"{step_dir(1)}/{base_file}"), report
        target = _empty_like(state)
        assert mgr.restore(target) == 2
        assert_same_state(target["model"], state["model"], what="the model")


def test_damaged_referenced_bytes_are_a_clear_error(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
        rec = _manifest(mgr.storage, 2)["leaves"]["model/frozen.weight"]["chunks"][0]
    path = tmp_path / step_dir(1) / rec["file"].split("/", 2)[2]
    raw = bytearray(path.read_bytes())
    raw[rec["offset"] + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ChecksumMismatchError) as ei:
            mgr.restore(_empty_like(state), step=2)
    msg = str(ei.value)
    assert "model/frozen.weight" in msg and "step 2" in msg and f"{step_dir(1)}/data/" in msg
    assert ".." not in msg  # the normalized path, which is where the bytes are


def test_no_reuse_across_digest_settings_and_from_old_checkpoints(tmp_path: Path) -> None:
    """A base written without incremental (or by an older writer) is reused; a base with
    another digest algorithm or block size is not (its digests mean something else)."""
    state = _state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
    with CheckpointManager(tmp_path, incremental=True, digest="sha256") as mgr:
        mgr.save(2, state).wait()
        assert all(f.startswith("data/") for f in _files(_manifest(mgr.storage, 2), "model/frozen.weight"))
    with CheckpointManager(tmp_path, incremental=True, digest="sha256", digest_block_bytes=4096) as mgr:
        mgr.save(3, state).wait()
        assert _files(_manifest(mgr.storage, 3), "model/frozen.weight")[0].startswith("data/")
        mgr.save(4, state).wait()
        assert _files(_manifest(mgr.storage, 4), "model/frozen.weight")[0].startswith(f"../{step_dir(3)}/")
        target = _empty_like(state)
        mgr.restore(target)
        assert_same_state(target["model"], state["model"], what="the model")
    with CheckpointManager(tmp_path, incremental=True) as mgr:  # xxh3 again: 1 is not the newest
        mgr.save(5, state).wait()
        assert _files(_manifest(mgr.storage, 5), "model/frozen.weight")[0].startswith("data/")
    assert verify_root(open_storage(str(tmp_path))).ok


def test_a_changed_box_or_dtype_is_written_again(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, incremental=True) as mgr:
        mgr.save(1, state).wait()
        state["model"]["frozen.weight"] = state["model"]["frozen.weight"].double()
        state["model"]["frozen.emb"] = state["model"]["frozen.emb"].reshape(64, 64)
        mgr.save(2, state).wait()
        m2 = _manifest(mgr.storage, 2)
        assert _files(m2, "model/frozen.weight")[0].startswith("data/")
        assert _files(m2, "model/frozen.emb")[0].startswith("data/")
        assert _files(m2, "model/head.weight")[0].startswith("../")
        target = _empty_like(state)
        mgr.restore(target)
        assert_same_state(target["model"], state["model"], what="the model")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_codecs_with_async_save_and_resharded_partial_restore_2_to_3(tmp_path: Path) -> None:
    """One torchrun launch: FSDP2 + DTensors saved at 2 ranks with incremental and zstd on
    (async), restored at 3 ranks whole and partially, bit for bit (dist/codecs_worker.py)."""
    from .._launch import run_codecs_worker

    checks = run_codecs_worker(
        tmp_path, [{"name": "local", "url": str(tmp_path / "root"), "options": {}, "mode": "codecs"}]
    )
    cases = {c["name"] for c in checks}
    assert "local: save w2 (async, codecs)" in cases and "local: partial restore at w3" in cases, cases
    assert len(checks) == 2 + 3 * 3
