"""The erasure code of the node tier (``tiers/erasure.py``): every pattern of up to m lost
files of a group rebuilds bit for bit from the survivors and the parity, m + 1 losses are
refused by name, unequal lengths are padded and cut back, memory stays within the pieces."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.tiers.erasure import (
    RS,
    XOR,
    Code,
    TooManyLost,
    check_code,
    encode_files,
    parity_length,
    rebuild_files,
)
from shardkeeper.core.tiers.placement import PARITY_DIR, Group, arrange, parity_name, prune


def _reader(data: bytes):  # type: ignore[no-untyped-def]
    def read(offset: int, buf: memoryview) -> None:
        assert offset + len(buf) <= len(data), "read past the file's end"
        buf[:] = data[offset : offset + len(buf)]

    return read


def _encode(code: Code, files: list[bytes], piece: int) -> list[bytes]:
    outs: list[bytearray] = [bytearray() for _ in range(code.m)]
    digests = encode_files(code, [len(f) for f in files], [_reader(f) for f in files], [o.extend for o in outs], piece)
    assert digests == [xxhash.xxh3_128_hexdigest(bytes(o)) for o in outs]
    assert all(len(o) == parity_length([len(f) for f in files]) for o in outs)
    return [bytes(o) for o in outs]


def _rebuild(
    code: Code, files: list[bytes], parity: list[bytes], lost: tuple[int, ...], piece: int
) -> dict[int, bytes]:
    shards = [*files, *parity]
    readers = {i: _reader(s) for i, s in enumerate(shards) if i not in lost}
    outs = {i: bytearray() for i in lost if i < code.k}
    digests = rebuild_files(code, [len(f) for f in files], readers, {i: o.extend for i, o in outs.items()}, piece)
    assert digests == {i: xxhash.xxh3_128_hexdigest(bytes(o)) for i, o in outs.items()}
    return {i: bytes(o) for i, o in outs.items()}


@pytest.mark.parametrize(("k", "m"), [(1, 1), (3, 1), (4, 1), (1, 2), (3, 2), (4, 3), (5, 2)])
def test_every_loss_up_to_m_rebuilds_bit_exact(k: int, m: int) -> None:
    rng = np.random.default_rng(k * 10 + m)
    # unequal lengths, one not a multiple of 8, one empty when k > 2, several pieces each
    lengths = [1000 - 37 * i for i in range(k)]
    if k > 2:
        lengths[1] = 0
    files = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    piece = 64
    code = Code(k, m)
    assert code.name == (XOR if m == 1 else RS)
    parity = _encode(code, files, piece)
    patterns = 0
    for count in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), count):
            got = _rebuild(code, files, parity, lost, piece)
            assert got == {i: files[i] for i in lost if i < k}, f"lost {lost}"
            patterns += 1
    assert patterns == sum(len(list(itertools.combinations(range(k + m), c))) for c in range(1, m + 1))


@pytest.mark.parametrize(("k", "m"), [(3, 1), (3, 2)])
def test_more_than_m_losses_is_a_clear_error(k: int, m: int) -> None:
    files = [os.urandom(100 + i) for i in range(k)]
    code = Code(k, m)
    parity = _encode(code, files, 32)
    for lost in itertools.combinations(range(k + m), m + 1):
        if not any(i < k for i in lost):
            continue
        with pytest.raises(TooManyLost, match=rf"{m + 1} of the group's {k + m} shards are lost.*rebuilds at most {m}"):
            _rebuild(code, files, parity, lost, 32)


def test_parity_length_pads_to_the_longest_in_words() -> None:
    assert parity_length([5, 17, 3]) == 24
    assert parity_length([16, 8]) == 16
    assert parity_length([0, 0]) == 0
    code = Code(2, 1)
    parity = _encode(code, [b"", b""], 8)
    assert parity == [b""]
    assert _rebuild(code, [b"", b""], parity, (0,), 8) == {0: b""}


def test_bad_codes_and_pieces_are_refused() -> None:
    with pytest.raises(ValueError, match="k=0, but a group needs at least 1 data node"):
        check_code(0, 1)
    with pytest.raises(ValueError, match="m=0, but parity needs at least 1 node"):
        check_code(3, 0)
    with pytest.raises(TypeError, match="k must be an int"):
        check_code(2.0, 1)
    with pytest.raises(TypeError, match="m must be an int"):
        check_code(2, True)
    with pytest.raises(ValueError, match="at most 256"):
        check_code(250, 7)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        encode_files(Code(2, 1), [1, 1], [_reader(b"a"), _reader(b"b")], [bytearray().extend], 12)


def test_memory_stays_within_the_pieces(tmp_path: Path) -> None:
    """32 MiB over 4 files on disk, coded in 256 KiB pieces: the peak of Python and numpy
    allocations is a few pieces per shard, not the files' size."""
    k, m, piece = 4, 2, 256 << 10
    paths = []
    for i in range(k):
        p = tmp_path / f"d{i}"
        p.write_bytes(os.urandom((8 << 20) - 1000 * i))
        paths.append(p)
    lengths = [p.stat().st_size for p in paths]

    def file_reader(path: Path):  # type: ignore[no-untyped-def]
        def read(offset: int, buf: memoryview) -> None:
            with open(path, "rb") as f:
                f.seek(offset)
                assert f.readinto(buf) == len(buf)

        return read

    code = Code(k, m)
    outs = [open(tmp_path / f"p{j}", "wb") for j in range(m)]  # noqa: SIM115 - closed below
    tracemalloc.start()
    try:
        encode_files(code, lengths, [file_reader(p) for p in paths], [o.write for o in outs], piece)
        enc_peak = tracemalloc.get_traced_memory()[1]
        for o in outs:
            o.close()
        tracemalloc.reset_peak()
        rebuilt = open(tmp_path / "r1", "wb")  # noqa: SIM115 - closed below
        readers = {0: file_reader(paths[0]), 2: file_reader(paths[2]), 3: file_reader(paths[3])}
        readers[k + 1] = file_reader(tmp_path / "p1")
        rebuild_files(code, lengths, readers, {1: rebuilt.write}, piece)
        rebuilt.close()
        dec_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = (k + m + 2) * piece
    assert enc_peak < bound, f"encode peaked at {enc_peak} bytes, over {bound}"
    assert dec_peak < bound, f"rebuild peaked at {dec_peak} bytes, over {bound}"
    assert (tmp_path / "r1").read_bytes() == paths[1].read_bytes()


def test_the_module_imports_no_torch_and_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['zfec'] = None\n"
        "from shardkeeper.core.tiers.erasure import Code\n"
        "Code(3, 1)\n"
        "try:\n"
        "    Code(3, 2)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'shardkeeper-core[erasure]'" in out.stdout, out.stdout + out.stderr


def test_groups_and_parity_holders() -> None:
    """Groups of k consecutive nodes, the last one shorter; each piece's m parity shards on m
    different nodes outside the group, the pieces spread evenly over those nodes."""
    assert arrange(4, 3, 1) == [Group(0, (0, 1, 2), (3,)), Group(1, (3,), (0, 1, 2))]
    assert [g.data for g in arrange(7, 3, 1)] == [(0, 1, 2), (3, 4, 5), (6,)]
    assert arrange(4, 2, 2) == [Group(0, (0, 1), (2, 3)), Group(1, (2, 3), (0, 1))]
    for count, k, m in [(4, 3, 1), (7, 3, 1), (8, 4, 1), (9, 4, 2), (5, 2, 3), (12, 4, 2)]:
        for g in arrange(count, k, m):
            held: dict[int, int] = {}
            for piece in range(24):
                nodes = [g.holder(j, piece, m) for j in range(m)]
                assert len(set(nodes)) == m and not set(nodes) & set(g.data), (count, k, m, g, piece)
                for n in nodes:
                    held[n] = held.get(n, 0) + 1
            if count % k == 0:  # every node outside holds the same share: m/k of a node's data per group
                assert set(held) == set(g.outside) and len(set(held.values())) == 1, (count, k, m, held)
    # every alternative the docs promise, replicas=1 included (before: not named)
    with pytest.raises(
        ValueError, match=r"k \+ m = 5 nodes .* share 4.*Pass erasure=\(3, 1\), a smaller m, or replicas=1"
    ):
        arrange(4, 4, 1)
    with pytest.raises(ValueError, match=r"share 2.*Pass erasure=\(1, 1\) or replicas=1"):
        arrange(2, 1, 2)
    with pytest.raises(ValueError, match=r"share 1.*Drop erasure="):
        arrange(1, 1, 1)


def test_the_option_is_checked_before_any_root_is_touched(tmp_path: Path) -> None:
    from shardkeeper.core import CheckpointManager

    p, local = tmp_path / "p", tmp_path / "l"
    with pytest.raises(ValueError, match="erasure= and local_keep= configure the local tier"):
        CheckpointManager(p, erasure=(3, 1))
    with pytest.raises(ValueError, match=r"replicas=1 and erasure=\(3, 1\) both protect.*pass one of them"):
        CheckpointManager(p, local=local, replicas=1, erasure=(3, 1))
    with pytest.raises(ValueError, match="k=0, but a group needs at least 1 data node"):
        CheckpointManager(p, local=local, erasure=(0, 1))
    with pytest.raises(ValueError, match="m=0, but parity needs at least 1 node"):
        CheckpointManager(p, local=local, erasure=(3, 0))
    with pytest.raises(TypeError, match=r"erasure must be a pair \(k, m\)"):
        CheckpointManager(p, local=local, erasure=3)  # type: ignore[arg-type]
    assert not p.exists() and not local.exists()
    # the root and the rank named (before: neither)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(p))}, rank 0: erasure=\(1, 1\) needs at least k \+ m = 2 nodes .* share 1"
    ):
        CheckpointManager(p, local=local, erasure=(1, 1))


def test_the_parity_of_steps_gone_from_a_node_is_pruned(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for step in (1, 2, 3):
        storage.put(parity_name(step, 0, 0), b"x")
    prune(storage, {2, 3})
    assert sorted(p.name for p in (tmp_path / PARITY_DIR).iterdir()) == ["step-000000000002", "step-000000000003"]


def test_a_shrunk_job_names_the_lost_nodes_of_the_job_that_saved() -> None:
    """Saved by 4 nodes under erasure=(2, 1), restored by 2 (nodes 2 and 3 gone): node 0
    holds group 1's parity, whose record names nodes 2 and 3. The note names them as nodes
    of the saving job (before: the restore raised IndexError on every rank)."""
    from shardkeeper.core.tiers.losses import lost_beyond_parity
    from shardkeeper.core.tiers.nodes import NodeMap

    def data(rank: int) -> str:
        return f"step-000000000004/data/r{rank:05d}-0-000.safetensors"

    record: dict[str, Any] = {
        "code": "xor", "group": 1, "k": 2, "m": 1, "shard": 0, "nodes": [2, 3], "length": 1000,
        "lengths": [1000, 1000], "members": [[[data(2), 1000]], [[data(3), 1000]]], "piece_bytes": 4 << 20,
        "pieces": [0], "digests": ["0" * 32], "size": 1000, "step": 4, "ok": True, "damage": None,
    }  # fmt: skip
    listings: list[dict[str, Any]] = [
        {"files": {"4": {data(0): 1000}}, "records": {"4": [record]}, "manifests": [4], "refs": {}, "dir": "/n0"},
        {"files": {"4": {data(1): 1000}}, "records": {}, "manifests": [4], "refs": {}, "dir": "/n1"},
    ]
    notes = lost_beyond_parity(listings, NodeMap(((0,), (1,))), (1, 1), None, None)
    assert len(notes) == 1, notes
    assert (
        "step 4 lost more nodes than parity rebuilds (group 1 (nodes 2, 3) lost node 2 (of the job that saved"
        in notes[0]
    )
    assert "node 3 (of the job that saved the step; this job has 2 nodes)" in notes[0], notes[0]
