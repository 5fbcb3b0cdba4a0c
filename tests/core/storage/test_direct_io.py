"""O_DIRECT writes on local storage (docs/decisions.md D19): page-aligned bytes go to the disk
straight from the staging buffer, everything else buffered, and the file is byte for byte what
a buffered write gives."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shardkeeper.core import CheckpointManager
from shardkeeper.core.storage import local_writer
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.storage.local_writer import DIRECT_ALIGN, DIRECT_MIN_BYTES
from shardkeeper.core.storage.wrapper import StorageWrapper

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")


def _aligned(n: int, seed: int) -> memoryview:
    """``n`` random bytes in page-aligned (anonymous mmap) memory."""
    m = mmap.mmap(-1, n)
    m.write(
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    )
    return memoryview(m)


@pytest.mark.parametrize(
    ("header", "start", "length"),
    [
        (0, 0, 4 << 20),  # all aligned
        (0, 0, (4 << 20) + 123),  # a partial last page
        (100, 100, 3 << 20),  # unaligned head, congruent buffer
        (100, 0, 3 << 20),  # not congruent: through the bounce buffer
        (0, 8, (20 << 20) + 5),  # misaligned buffer, more than one bounce buffer's worth
    ],
)
def test_writer_splits_aligned_and_unaligned_bytes(tmp_path: Path, header: int, start: int, length: int) -> None:
    data = _aligned(start + length + DIRECT_ALIGN, seed=length)
    w = LocalStorage(tmp_path).open_writer("f.bin")
    w.write(b"h" * header)
    w.write(data[start : start + length])
    w.write(b"tail")
    w.close()
    assert (tmp_path / "f.bin").read_bytes() == b"h" * header + bytes(data[start : start + length]) + b"tail"
    assert w.direct_bytes >= length - 2 * DIRECT_ALIGN, w.direct_bytes
    assert w.direct_bytes % DIRECT_ALIGN == 0
    congruent = (start - header) % DIRECT_ALIGN == 0
    # Congruent memory goes to the disk as it is; other memory through the bounce buffer.
    assert w.bounced_bytes == (0 if congruent else w.direct_bytes), (w.bounced_bytes, w.direct_bytes)


def test_small_and_disabled_writes_stay_buffered_bytes_bounce(tmp_path: Path) -> None:
    small = _aligned(DIRECT_MIN_BYTES - DIRECT_ALIGN, seed=1)
    big = bytes(_aligned(2 << 20, seed=2))  # bytes: read-only memory, copied through the bounce buffer
    w = LocalStorage(tmp_path).open_writer("a")
    w.write(small)
    assert w.direct_bytes == 0
    w.write(big)
    w.close()
    assert w.bounced_bytes == w.direct_bytes >= (2 << 20) - DIRECT_ALIGN
    assert (tmp_path / "a").read_bytes() == bytes(small) + big
    w = LocalStorage(tmp_path, direct_io=False).open_writer("b")
    w.write(_aligned(2 << 20, seed=3))
    w.close()
    assert w.direct_bytes == 0 and (tmp_path / "b").stat().st_size == 2 << 20


def test_a_file_system_that_refuses_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch) -> None:
    """Some file systems refuse O_DIRECT with EINVAL (none here does, hence the patch): the same
    bytes then go out buffered, and later writes do not try again."""
    real = local_writer.fcntl.fcntl
    calls = []

    def refusing(fd: int, cmd: int, arg: int = 0) -> Any:
        if cmd == local_writer.fcntl.F_SETFL and arg & os.O_DIRECT:
            calls.append(arg)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(local_writer.fcntl, "fcntl", refusing)
    data = _aligned(4 << 20, seed=4)
    w = LocalStorage(tmp_path).open_writer("f")
    w.write(data[: 2 << 20])
    w.write(data[2 << 20 :])
    w.close()
    assert (tmp_path / "f").read_bytes() == bytes(data)
    assert w.direct_bytes == 0 and len(calls) == 1


class _Recording(StorageWrapper):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.writers: list[Any] = []

    def open_writer(self, path: str) -> Any:
        w = self.inner.open_writer(path)
        self.writers.append(w)
        return w


def _off_the_grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to memory 32 bytes past a multiple of 64. A large chunk's file offset is a
    multiple of 64, so that memory is never congruent with it modulo the page and every write
    of it from its own memory goes through the bounce buffer. Memory from the allocator is
    congruent by chance (about 1 in 64 once large blocks come from the heap), which made this
    test's bounce count fail now and then."""
    n = t.numel() * t.element_size()
    raw = torch.empty(n + 128, dtype=torch.uint8)
    start = (32 - raw.data_ptr()) % 64
    out = raw[start : start + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize(("direct_io", "async_save"), [(True, True), (True, False), (False, True)])
def test_saves_write_shards_with_o_direct(tmp_path: Path, direct_io: bool, async_save: bool) -> None:
    """Async saves write from the page-aligned staging buffer as it is; synchronous ones write
    the tensors' own memory, copied through the bounce buffer."""
    g = torch.Generator().manual_seed(0)
    state = {
        "w": _off_the_grid(torch.randn(1000, 1000, generator=g)),
        "h": _off_the_grid(torch.randn(800, 777, generator=g).bfloat16()),
        "small": torch.arange(10),
        "meta": {"k": 1},
    }
    storage = _Recording(LocalStorage(tmp_path, direct_io=direct_io))
    with CheckpointManager(storage, max_files_per_rank=2, min_file_bytes=1 << 20) as mgr:  # type: ignore[arg-type]
        mgr.save(1, state, async_save=async_save).wait()
        data_writers = [w for w in storage.writers if hasattr(w, "direct_bytes")]
        direct = sum(w.direct_bytes for w in data_writers)
        bounced = sum(w.bounced_bytes for w in data_writers)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}
        mgr.restore(target)
    for k in ("w", "h", "small"):
        assert torch.equal(target[k], state[k]), k
    payload = sum(t.numel() * t.element_size() for t in (state["w"], state["h"], state["small"]))
    if direct_io:
        assert direct >= payload - 4 * len(data_writers) * DIRECT_ALIGN, (direct, payload)
        assert bounced == (0 if async_save else direct), (bounced, direct)
    else:
        assert direct == 0
    files = sorted((tmp_path / "step-000000000001" / "data").iterdir())
    loaded = {}
    for f in files:  # still plain safetensors files: the padded header is valid JSON whitespace
        loaded.update(load_file(str(f)))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["h"], state["h"])
