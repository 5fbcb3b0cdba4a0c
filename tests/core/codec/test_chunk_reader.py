"""The chunk reader needs no torch: in a process where ``import torch`` fails, it reads and
verifies the chunks of a checkpoint the manager wrote (raw and zstd-encoded), and names the
damaged block of a corrupted file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.storage import LocalStorage

# Runs in a child process: torch is made unimportable before anything else is imported.
_CHILD = r"""
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from shardkeeper.core.codec.read import ChunkReader
from shardkeeper.core.commit.committed import load_manifest
from shardkeeper.core.errors import ChecksumMismatchError
from shardkeeper.core.format.manifest import itemsize
from shardkeeper.core.commit.files import resolve_file
from shardkeeper.core.storage import LocalStorage

root, step, key, expect_file = sys.argv[1:]
storage = LocalStorage(root, fsync=False)
m = load_manifest(storage, int(step))
leaf = m.leaves[key]
reader = ChunkReader.of(storage, m, where=f"step {step}", remedy="restore an earlier step")
out = {"torch": sorted(k for k in sys.modules if k.startswith("torch."))}
if sys.modules["torch"] is not None:
    out["torch"].append("torch")
isz = itemsize(leaf.dtype)
got = bytearray()
for c in leaf.chunks:  # one dimension-0 slab after another: their bytes concatenate
    buf = bytearray(c.numel * isz)
    path = resolve_file(m.step, c.file)
    try:
        reader.read_chunk(path, c, memoryview(buf), key, isz)
    except ChecksumMismatchError as e:
        out["error"] = str(e)
    out.setdefault("bad", []).extend(
        [b.block, b.start, b.end] for w in reader.scan(path, c, 2 * reader.block) for b in w.bad)
    out.setdefault("encodings", []).append(c.encoding)
    got += buf
out["equal"] = bytes(got) == open(expect_file, "rb").read()
print(json.dumps(out))
"""


def _child(root: Path, step: int, key: str, expect: Path) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(step), key, str(expect)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_chunk_reader_reads_and_verifies_without_torch(tmp_path: Path, compression: str | None) -> None:
    if compression:
        pytest.importorskip("zstandard")
    root = tmp_path / "run"
    # Compressible (zeros with a ramp) and several digest blocks, so the reader crosses blocks.
    w = torch.zeros(256, 64)
    w[:, 0] = torch.arange(256, dtype=torch.float32)
    with CheckpointManager(str(root), digest_block_bytes=4096, compression=compression) as mgr:
        mgr.save(1, {"model": {"w": w}}).wait()
    expect = tmp_path / "w.bin"
    expect.write_bytes(w.numpy().tobytes())

    ok = _child(root, 1, "model/w", expect)
    assert ok["torch"] == []
    assert ok["equal"] and "error" not in ok and ok["bad"] == []
    encodings = set(ok["encodings"])
    if compression is None:
        assert encodings == {"raw"}
    else:
        assert encodings - {"raw"}, encodings  # frames were read and decoded

    # Flip one stored byte: the reader refuses the chunk, naming the key and the block's range.
    c = load_manifest(LocalStorage(root, fsync=False), 1).leaves["model/w"].chunks[0]
    data = root / str(resolve_file(1, c.file))
    raw = bytearray(data.read_bytes())
    idx = 1 if c.length > 4096 else 0  # the chunk's second digest block where it has one
    raw[c.offset + idx * 4096 + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = _child(root, 1, "model/w", expect)
    assert bad["torch"] == []
    assert not bad["equal"]
    block = [c.offset + idx * 4096, c.offset + min((idx + 1) * 4096, c.length)]
    assert bad["bad"] == [[idx, *block]]
    assert bad["error"].startswith("checksum mismatch in ")
    assert f"at bytes [{block[0]}, {block[1]}) of key 'model/w', step 1:" in bad["error"]
    assert bad["error"].endswith("The stored bytes are damaged: restore an earlier step")
