"""Unit tests of the pieces the protocol stands on: tiling, chunk runs, writer balance, names,
manifest validation, and a sha256 round trip through the manager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.format.layout import parse_step_dir, step_dir
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord, check_tiling, safe_relative_path
from shardkeeper.core.state.chunks import _runs, balance_plain


def box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> ChunkRecord:
    return ChunkRecord("data/f", 0, 0, offsets, shape, ())


def test_tiling_accepts_an_exact_cover_and_names_every_flaw() -> None:
    shape = (4, 6)
    assert check_tiling("w", shape, [box((0, 0), (2, 6)), box((2, 0), (2, 3)), box((2, 3), (2, 3))]) is None
    assert "cover 18 of 24" in check_tiling("w", shape, [box((0, 0), (2, 6)), box((2, 0), (2, 3))])
    assert "outside" in check_tiling("w", shape, [box((0, 0), (4, 6)), box((3, 5), (1, 2))])
    # same volume, but one box overlaps another and leaves a hole
    why = check_tiling("w", shape, [box((0, 0), (2, 6)), box((1, 0), (2, 6)), box((3, 0), (1, 3)), box((3, 3), (1, 3))])
    assert why is not None
    assert check_tiling("s", (), [box((), ())]) is None
    assert check_tiling("e", (0, 3), []) is None


def test_runs_split_global_indices_into_contiguous_pieces() -> None:
    assert _runs(torch.arange(3, 8)) == [(3, 0, 5)]
    assert _runs(torch.tensor([0, 1, 4, 5, 9])) == [(0, 0, 2), (4, 2, 2), (9, 4, 1)]
    assert _runs(torch.empty(0, dtype=torch.long)) == []


def test_replicated_plain_tensors_are_spread_evenly_and_deterministically() -> None:
    sizes = {f"k{i}": s for i, s in enumerate([100, 90, 80, 10, 10, 10])}
    a = balance_plain(sizes, 3)
    assert a == balance_plain(dict(reversed(sizes.items())), 3)  # order-independent
    load = [sum(sizes[k] for k, r in a.items() if r == rank) for rank in range(3)]
    assert max(load) - min(load) <= 10, load


def test_step_names_are_canonical() -> None:
    assert step_dir(1200) == "step-000000001200"
    assert parse_step_dir("step-000000001200") == 1200
    assert parse_step_dir("step-0000000001200") is None  # another spelling of the same step
    assert parse_step_dir("step-12") is None and parse_step_dir("LATEST") is None


@pytest.mark.parametrize(
    "path, ok",
    [
        ("data/r00000-ab-000.safetensors", True),
        ("../step-000000000100/data/x.safetensors", True),
        ("/etc/passwd", False),
        ("../../etc/passwd", False),
        ("data/../../x", False),
        ("../step-1/data/x", False),
        ("", False),
    ],
)
def test_manifest_file_paths_stay_inside_the_root(path: str, ok: bool) -> None:
    assert safe_relative_path(path) is ok


def test_sha256_round_trip_and_a_manifest_that_lies_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.arange(3000, dtype=torch.float32).reshape(30, 100)}
    with CheckpointManager(tmp_path, digest="sha256", digest_block_bytes=4096) as mgr:
        mgr.save(1, state).wait()
        target = {"w": torch.zeros(30, 100)}
        mgr.restore(target)
    assert torch.equal(target["w"], state["w"])
    path = tmp_path / "step-000000000001" / "manifest.json"
    m = json.loads(path.read_text())
    assert m["digest_algorithm"] == "sha256"
    chunk = m["leaves"]["w"]["chunks"][0]
    digests = chunk["digests"].split(",")
    assert len(digests) == 3 and all(len(d) == 64 for d in digests)  # 12000 B / 4096
    chunk["digests"] = ",".join(digests[:2])  # a manifest that would leave a block unverified
    with pytest.raises(CorruptCheckpointError, match="digests"):
        Manifest.loads(json.dumps(m).encode(), where=str(path))
    chunk["digests"] = ",".join(["0" * 64] * 3)
    chunk["file"] = "../../outside.safetensors"
    with pytest.raises(CorruptCheckpointError, match="inside the root"):
        Manifest.loads(json.dumps(m).encode(), where=str(path))


def _report(rank: int, declared: dict, chunks: dict) -> dict:
    return {"rank": rank, "declared": declared, "chunks": chunks, "files": {}, "objects": {}, "per_rank_prefixes": []}


def _chunk(offsets: list[int], shape: list[int]) -> dict:
    n = 4 * shape[0] * shape[1]
    return {"file": "data/f", "offset": 0, "length": n, "offsets": offsets, "shape": shape, "digests": "x"}


def test_coordinator_merges_ranks_and_names_every_disagreement() -> None:
    from shardkeeper.core.commit.merge import assemble_manifest
    from shardkeeper.core.errors import StateMismatchError

    decl = {"w": ["tensor", "float32", [4, 2]]}
    kw = {"world_size": 2, "digest": "xxh3_128", "block_bytes": 1 << 20, "metadata": {}}
    halves = [_report(0, decl, {"w": [_chunk([0, 0], [2, 2])]}), _report(1, decl, {"w": [_chunk([2, 0], [2, 2])]})]
    m = assemble_manifest(7, "a", halves, **kw)
    assert [c.offsets for c in m.leaves["w"].chunks] == [(0, 0), (2, 0)] and m.world_size == 2
    # a replica written by two ranks counts once
    dup = [_report(0, decl, {"w": [_chunk([0, 0], [4, 2])]}), _report(1, decl, {"w": [_chunk([0, 0], [4, 2])]})]
    assert len(assemble_manifest(7, "a", dup, **kw).leaves["w"].chunks) == 1
    with pytest.raises(StateMismatchError, match=r"step 7.*w: chunks cover 4 of 8"):
        assemble_manifest(7, "a", [halves[0], _report(1, decl, {})], **kw)
    other = {"w": ["tensor", "bfloat16", [4, 2]]}
    with pytest.raises(StateMismatchError, match=r"rank 0 has float32 \[4, 2\], rank 1 has bfloat16"):
        assemble_manifest(7, "a", [halves[0], _report(1, other, {"w": [_chunk([2, 0], [2, 2])]})], **kw)


def test_ranks_send_a_digest_of_their_declarations_and_a_mismatch_names_them() -> None:
    from shardkeeper.core.commit.merge import assemble_manifest, declared_digest
    from shardkeeper.core.errors import StateMismatchError

    decl = {"w": ["tensor", "float32", [4, 2]]}
    kw = {"world_size": 3, "digest": "xxh3_128", "block_bytes": 1 << 20, "metadata": {}}
    coord = {**_report(0, decl, {"w": [_chunk([0, 0], [2, 2])]}), "declared_digest": declared_digest(decl)}
    same = {**_report(1, {}, {"w": [_chunk([2, 0], [2, 2])]}), "declared_digest": declared_digest(decl)}
    other = {**_report(2, {}, {}), "declared_digest": declared_digest({"w": ["tensor", "float32", [4, 3]]})}
    assert assemble_manifest(7, "a", [coord, same], **{**kw, "world_size": 2}).leaves["w"].shape == (4, 2)
    with pytest.raises(
        StateMismatchError, match=r"ranks \[2\] hold states whose keys, dtypes or shapes differ from rank 0's"
    ):
        assemble_manifest(7, "a", [coord, same, other], **kw)


def test_bytes_leaves_are_verified_like_tensors(tmp_path: Path) -> None:
    from shardkeeper.core import ChecksumMismatchError

    blob = bytes(range(256)) * 40
    with CheckpointManager(tmp_path, digest_block_bytes=1024) as mgr:
        mgr.save(1, {"blob": blob}).wait()
        target = {"blob": b""}
        mgr.restore(target)
        assert target["blob"] == blob
        chunk = json.loads((tmp_path / "step-000000000001" / "manifest.json").read_text())["leaves"]["blob"]["chunks"][
            0
        ]
        with open(tmp_path / "step-000000000001" / chunk["file"], "r+b") as f:
            f.seek(chunk["offset"] + 5000)
            f.write(b"\xff")
        with pytest.raises(ChecksumMismatchError, match=r"'blob'.*step 1"):
            mgr.restore({"blob": b""}, step=1)


def test_synchronous_saves_write_from_the_tensors_own_memory(tmp_path: Path) -> None:
    """Large contiguous tensors are written from their own memory; strided ones and small
    ones (below DIRECT_MIN_BYTES, cheaper to copy than to write one by one) are staged."""
    from shardkeeper.core.save.stage import DIRECT_MIN_BYTES

    rows = DIRECT_MIN_BYTES // (4 * 256)  # 1 MiB of float32 in rows of 256
    base = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256)
    state = {
        "t": base.t(),
        "c": base + 1,
        "h": (base / 7).to(torch.bfloat16).repeat(2, 1),
        "b": base[:4] > 5,
        "s": torch.tensor(3),
    }
    assert not state["t"].is_contiguous()
    staged = state["t"].nbytes + state["b"].nbytes + state["s"].nbytes
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state, async_save=False)
        # t (strided), b and s (small) were staged; c and h were not
        assert staged <= mgr._stager.buffer_bytes < staged + 4096 + 3 * 64
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(target)
    for k, v in state.items():
        assert target[k].dtype == v.dtype and torch.equal(target[k], v), k


def test_an_unchecked_chunk_record_equals_a_constructed_one() -> None:
    """ChunkRecord is slotted (restore holds one per chunk it reads); ``unchecked`` sets the
    slots directly and must give exactly what the frozen constructor gives."""
    from shardkeeper.core.format.records import ChunkRecord

    fields = ("data/r00000-0a1b2c3d-000.safetensors", 4096, 80, (2, 0), (5, 4), ("ab" * 16,))
    rec = ChunkRecord.unchecked(*fields)
    assert rec == ChunkRecord(*fields) and hash(rec) == hash(ChunkRecord(*fields))
    assert (rec.encoding, rec.content) == ("raw", "") and not hasattr(rec, "__dict__")
    with pytest.raises(AttributeError):
        rec.offset = 0  # type: ignore[misc]


@pytest.mark.timeout(60)
def test_block_digests_of_a_large_chunk_are_counted_once_not_per_block() -> None:
    """A chunk of 128 MiB has 2,048 digest blocks of 64 KiB (a 512 MiB one 8,192): the
    verification loop asks for the count per block, and counting by scanning the comma-joined
    text each time made a restore's verification quadratic (seconds per chunk). 100,000
    blocks: quadratic is hours, linear milliseconds."""
    from shardkeeper.core.format.records import BlockDigests

    n = 100_000
    digests = BlockDigests(",".join(f"{i:032x}" for i in range(n)))
    assert sum(1 for i in range(n) if i < len(digests)) == n
    assert digests[n - 1] == f"{n - 1:032x}" and len(digests) == n
    assert len(BlockDigests("")) == 0 and len(BlockDigests("ab")) == 1
