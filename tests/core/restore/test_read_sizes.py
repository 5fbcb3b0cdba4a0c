"""How a restore cuts its reads straight into the target: at ``max_read_bytes`` (64 MiB by
default) for one rank, in parts of 8 MiB only where ranks may share reads (the exchange
holds what a read needs until it runs). Smaller parts cost: a plain restore of 256 MiB from
the page cache took a quarter longer in reads of 8 MiB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.restore.plan import Op
from shardkeeper.core.restore.reads import schedule
from shardkeeper.core.storage import LocalStorage
from tests.checks import assert_same_state


class _Reads(LocalStorage):
    """Local storage that records the length of each read into a caller's buffer."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lengths: list[int] = []

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        if path.endswith(".bin") or "/data" in path or path.endswith(".safetensors"):
            self.lengths.append(len(buffer))
        super().read_into(path, offset, buffer)


@pytest.mark.parametrize(("max_read_mib", "reads"), [(None, 1), (16, 2)])
def test_one_rank_reads_a_tensor_into_place_in_reads_of_max_read_bytes(
    tmp_path: Path, max_read_mib: int | None, reads: int
) -> None:
    state = {"w": torch.randn(8 << 20, generator=torch.Generator().manual_seed(0))}  # 32 MiB
    most = 64 << 20 if max_read_mib is None else max_read_mib << 20  # (64 MiB: the default)
    storage = _Reads(tmp_path / "root")
    with CheckpointManager(storage, async_save=False, max_read_bytes=most) as mgr:
        mgr.save(1, state)
        storage.lengths.clear()
        got = {"w": torch.empty_like(state["w"])}
        assert mgr.restore(got) == 1
    assert_same_state(got, state, what="step 1")
    big = [n for n in storage.lengths if n >= 1 << 20]
    assert len(big) == reads and sum(big) == 32 << 20, storage.lengths  # (before: 4 reads of 8 MiB)


def test_where_ranks_may_share_reads_direct_reads_come_in_parts_of_8_mib(tmp_path: Path) -> None:
    """The schedule of one 32 MiB chunk read whole into its tensor: one read alone, four of
    8 MiB (whole digest blocks, contiguous slices of the tensor) where ranks may share."""
    w = torch.randn(8 << 20, generator=torch.Generator().manual_seed(0))
    with CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        mgr.save(1, {"w": w})
        manifest = mgr.manifest(1)
    ((_, chunk),) = manifest.chunks()
    dest = torch.empty_like(w)
    op = Op("w", chunk, torch.float32, dest, (0,), tuple(w.shape), 0, 32 << 20)
    alone, _, _ = schedule([op], manifest.digest_block_bytes, 32 << 20, 64 << 20)
    shared, _, _ = schedule([op], manifest.digest_block_bytes, 32 << 20, 64 << 20, shared=True)
    assert [(o.start, o.end) for o in alone] == [(0, 32 << 20)]
    assert [(o.start, o.end) for o in shared] == [(i << 23, (i + 1) << 23) for i in range(4)]
    assert all(o.dest.data_ptr() == dest.data_ptr() + o.start for o in shared)
