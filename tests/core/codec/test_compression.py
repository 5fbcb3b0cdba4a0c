"""zstd compression per chunk (``compression="zstd"``): decided per chunk, digests over the
stored bytes (verify needs no decompression), a compressed chunk read whole on a partial
restore, bit-for-bit restores on every backend, and clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import (
    CheckpointManager,
    ChecksumMismatchError,
    CorruptCheckpointError,
    Fragment,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.safetensors import FRAMED_MAGIC
from shardkeeper.core.storage import open_storage
from shardkeeper.core.verify.root import verify_root
from tests.checks import assert_same_state

pytest.importorskip("zstandard")
pytestmark = pytest.mark.timeout(300)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "zeros": torch.zeros(256, 1024),  # 1 MiB: compresses to almost nothing
        "bf16": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16),  # weights
        "noise": torch.randint(-(2**31), 2**31 - 1, (128, 256), generator=g, dtype=torch.int32),  # stays raw
        "ids": torch.arange(40_000, dtype=torch.int64),
        "small": torch.zeros(8, 8),  # below the size worth compressing
        "blob": b"\x00\x01" * 50_000,  # a bytes leaf
        "step": 7,
    }


def _target(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: torch.full_like(v, 3) for k, v in state.items() if isinstance(v, torch.Tensor)}
    out["blob"] = b""
    out["step"] = 0
    return out


def _encodings(m: dict[str, Any]) -> dict[str, set[str]]:
    return {
        k: {c.get("encoding", "raw") for c in leaf["chunks"]} for k, leaf in m["leaves"].items() if "chunks" in leaf
    }


def test_compressed_round_trip_on_every_backend(storage_root) -> None:
    storage = storage_root.open()
    state = _state()
    with CheckpointManager(
        storage_root.url, storage_options=storage_root.options, compression="zstd", compression_level=3
    ) as mgr:
        mgr.save(1, state)  # async
        mgr.wait()
        m = json.loads(storage.read_bytes(f"{step_dir(1)}/manifest.json"))
        assert m["format_version"] == 1 and "requires" not in m  # encodings are of the core schema
        enc = _encodings(m)
        # multi-byte dtypes are byte-shuffled before zstd; bytes leaves (uint8) are not
        assert enc["zeros"] == enc["bf16"] == enc["ids"] == {"shuffle-zstd"}, enc
        assert enc["blob"] == {"zstd"}, enc
        assert enc["noise"] == enc["small"] == {"raw"}, enc
        logical = sum(leaf_bytes(leaf) for leaf in m["leaves"].values())
        stored = sum(f["size_bytes"] for f in m["files"].values())
        assert stored < 0.6 * logical, (stored, logical)
        for rel in m["files"]:
            assert storage.read_range(f"{step_dir(1)}/{rel}", 0, 8) == FRAMED_MAGIC
        target = _target(state)
        mgr.restore(target)
        assert_same_state(target, state)
        part = _target(state)
        mgr.restore(part, only=["bf16", "noise"])
        assert torch.equal(part["bf16"], state["bf16"]) and torch.equal(part["noise"], state["noise"])
        assert (part["zeros"] == 3).all()
    assert verify_root(storage).ok


def leaf_bytes(leaf: dict[str, Any]) -> int:
    if leaf["kind"] == "object":
        return 0
    size = {"float32": 4, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}[leaf["dtype"]]
    n = 1
    for s in leaf["shape"]:
        n *= s
    return n * size


def test_partial_restore_reads_a_compressed_chunk_whole(tmp_path: Path) -> None:
    state = {"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024) % 7}
    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, state).wait()
        chunk = mgr.manifest(1).leaves["w"].chunks[0]
        assert chunk.encoding == "shuffle-zstd" and chunk.length < 64 * 1024 * 4 // 10
        # A ZeRO-style fragment of a quarter of the tensor, starting mid-row.
        local = torch.zeros(16 * 1024)
        mgr.restore({"w": Fragment(local, (64, 1024), 5000)})
        assert torch.equal(local, state["w"].reshape(-1)[5000 : 5000 + 16 * 1024])
        st = mgr.last_restore_stats
        assert st is not None
        assert st.bytes_needed == 16 * 1024 * 4
        assert st.bytes_read == chunk.length  # the stored frame, read once, whole


def test_incremental_and_compression_compose(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, compression="zstd", incremental=True) as mgr:
        mgr.save(1, state).wait()
        state["noise"].add_(1)
        mgr.save(2, state).wait()
        m2 = mgr.manifest(2)
        zeros = m2.leaves["zeros"].chunks[0]
        assert zeros.file.startswith(f"../{step_dir(1)}/") and zeros.encoding == "shuffle-zstd" and zeros.content
        assert m2.leaves["noise"].chunks[0].file.startswith("data/")
        target = _target(state)
        mgr.restore(target)
        assert_same_state(target, state)
    assert verify_root(open_storage(str(tmp_path))).ok


def test_damaged_compressed_bytes_are_found_by_verify_and_restore(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, state).wait()
        c = mgr.manifest(1).leaves["bf16"].chunks[0]
    path = tmp_path / step_dir(1) / c.file
    raw = bytearray(path.read_bytes())
    raw[c.offset + c.length // 2] ^= 0x55
    path.write_bytes(bytes(raw))
    report = verify_root(open_storage(str(tmp_path)))
    assert not report.ok
    digest_problems = [p for p in report.all_problems if p.kind == "digest"]
    assert digest_problems and digest_problems[0].key == "bf16"
    assert c.offset <= digest_problems[0].start < c.offset + c.length
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ChecksumMismatchError, match="bf16"):
            mgr.restore(_target(state), step=1)


def test_incompressible_state_keeps_plain_safetensors_files(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    w = torch.randint(-(2**31), 2**31 - 1, (256, 256), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, {"w": w}).wait()
        m = mgr.manifest(1)
        assert m.leaves["w"].chunks[0].encoding == "raw"
        (rel,) = m.files
    loaded = safetensors_torch.load_file(str(tmp_path / step_dir(1) / rel))
    assert torch.equal(loaded["w"], w)
    assert verify_root(open_storage(str(tmp_path))).ok


def test_missing_zstandard_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, {"z": torch.zeros(64, 1024)}).wait()
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"shardkeeper-core\[zstd\]"):
        CheckpointManager(tmp_path, compression="zstd")
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ImportError, match=r"shardkeeper-core\[zstd\]"):
            mgr.restore({"z": torch.ones(64, 1024)})


def test_byte_shuffle_round_trips_every_item_size() -> None:
    from shardkeeper.core.codec.compression import decompress_into, encoding_for, maybe_compress

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.int16, torch.uint8):
        t = (torch.arange(50_000) % 251).to(dtype)
        raw = t.view(torch.uint8).numpy().tobytes()
        isz = t.element_size()
        frame = maybe_compress(memoryview(raw), 3, isz)
        assert frame is not None and len(frame) < len(raw) // 4, dtype
        out = bytearray(len(raw))
        decompress_into(frame, memoryview(out), "test", isz if encoding_for(isz) == "shuffle-zstd" else 1)
        assert bytes(out) == raw, dtype


def test_bad_options_and_hostile_encodings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        CheckpointManager(tmp_path, compression="lz4")
    with pytest.raises(ValueError, match="compression_level"):
        CheckpointManager(tmp_path, compression="zstd", compression_level=99)
    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, {"z": torch.zeros(64, 1024)}).wait()
    mpath = tmp_path / step_dir(1) / "manifest.json"
    good = json.loads(mpath.read_text())
    # An encoding no reader knows is damage, named.
    bad = json.loads(json.dumps(good))
    for leaf in bad["leaves"].values():
        for c in leaf.get("chunks", ()):
            if c.get("encoding", "raw") != "raw":
                c["encoding"] = "lz4"
    mpath.write_text(json.dumps(bad))
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="unknown chunk encoding 'lz4'"):
            mgr.restore({"z": torch.ones(64, 1024)}, step=1)
    mpath.write_text(json.dumps(good))
    # A frame whose size claim disagrees with the box: refused before anything is allocated.
    from shardkeeper.core.codec.compression import decompress_into, maybe_compress

    frame = maybe_compress(memoryview(bytes(100_000)), 3)
    assert frame is not None
    with pytest.raises(CorruptCheckpointError, match="100000 bytes"):
        decompress_into(frame, memoryview(bytearray(4096)), "step 1: key 'z'")


def test_verify_checks_the_frame_size_against_the_box(tmp_path: Path) -> None:
    """A frame whose digests match (a broken writer) but whose size claim disagrees with the
    box is damage too: verify reports it without decoding, restore refuses it."""
    import zstandard

    from shardkeeper.core.format.digest import block_digests

    with CheckpointManager(tmp_path, compression="zstd") as mgr:
        mgr.save(1, {"z": torch.zeros(64, 1024)}).wait()
        c = mgr.manifest(1).leaves["z"].chunks[0]
    frame = zstandard.ZstdCompressor().compress(bytes(64 * 1024 * 4 - 8))  # 8 bytes short
    path = tmp_path / step_dir(1) / c.file
    data = path.read_bytes()
    path.write_bytes(data[: c.offset] + frame)
    mpath = tmp_path / step_dir(1) / "manifest.json"
    m = json.loads(mpath.read_text())
    (rec,) = m["leaves"]["z"]["chunks"]
    rec["length"] = len(frame)
    rec["digests"] = ",".join(block_digests(memoryview(frame), m["digest_algorithm"], m["digest_block_bytes"]))
    m["files"][c.file]["size_bytes"] = c.offset + len(frame)
    mpath.write_text(json.dumps(m))
    report = verify_root(open_storage(str(tmp_path)))
    kinds = [p.kind for p in report.all_problems]
    assert kinds == ["encoding"], [str(p) for p in report.all_problems]
    assert "declares 262136 bytes" in str(report.all_problems[0])
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="262136"):
            mgr.restore({"z": torch.ones(64, 1024)}, step=1)


def test_large_chunks_are_compressed_in_slabs_and_read_partially(tmp_path: Path) -> None:
    """A chunk over SLAB_BYTES is stored as slabs of whole rows, one frame each: a partial
    restore reads only the frames it overlaps; an incremental save reuses unchanged slabs."""
    from shardkeeper.core.codec.compression import SLAB_BYTES

    rows, cols = 2048, 1536  # 12 MiB of fp32: three slabs of 4 MiB
    w = (torch.arange(rows * cols, dtype=torch.float32) % 13).reshape(rows, cols)
    with CheckpointManager(tmp_path, compression="zstd", incremental=True) as mgr:
        mgr.save(1, {"w": w}).wait()
        chunks = mgr.manifest(1).leaves["w"].chunks
        assert len(chunks) == 3 and all(c.numel * 4 <= SLAB_BYTES + cols * 4 for c in chunks)
        assert {c.encoding for c in chunks} == {"shuffle-zstd"}
        local = torch.zeros(100 * cols)  # 100 rows inside the second slab
        mgr.restore({"w": Fragment(local, (rows, cols), 700 * cols)})
        assert torch.equal(local, w[700:800].reshape(-1))
        st = mgr.last_restore_stats
        assert st is not None and st.bytes_read == chunks[1].length  # one frame, not three
        w[-1, -1] = 99.0  # only the last slab changes
        mgr.save(2, {"w": w}).wait()
        files = [c.file for c in mgr.manifest(2).leaves["w"].chunks]
        assert [f.startswith("../") for f in files] == [True, True, False], files
        target = {"w": torch.empty(rows, cols)}
        mgr.restore(target)
        assert torch.equal(target["w"], w)


def test_codecs_survive_the_columnar_chunk_table(tmp_path: Path) -> None:
    """Manifests of many chunks use the chunk table (format/columns.py): encodings, content ids
    and references must round-trip through it (restore, verify, reuse)."""
    from shardkeeper.core.format.columns import TABLE_MIN_CHUNKS

    n = TABLE_MIN_CHUNKS + 8
    state = {f"t{i}": torch.full((1100,), float(i % 5)) for i in range(n)}  # 4400 B: compressed
    with CheckpointManager(tmp_path, compression="zstd", incremental=True) as mgr:
        mgr.save(1, state).wait()
        state["t7"].add_(1)
        mgr.save(2, state).wait()
        assert "chunk_table" in json.loads((tmp_path / step_dir(2) / "manifest.json").read_text())
        m2 = mgr.manifest(2)
        c = m2.leaves["t3"].chunks[0]
        assert c.file.startswith(f"../{step_dir(1)}/") and c.encoding == "shuffle-zstd" and c.content
        assert m2.leaves["t7"].chunks[0].file.startswith("data/")
        target = {k: torch.empty_like(v) for k, v in state.items()}
        mgr.restore(target)
        assert all(torch.equal(target[k], v) for k, v in state.items())
    assert verify_root(open_storage(str(tmp_path))).ok
