"""Bounded work on a hostile described step (docs/format.md 3.8, 3.9 and 12): a manifest of a
kilobyte that claims millions of ranks costs a reader what the step's files back, not what the
manifest claims. Each step is a real group-commit save (``test_paged_damage``'s ``_save``:
the real index writer, ``fold_group``, ``assemble_manifest``, ``commit_manifest``) whose
manifest and first page are then rewritten as an attacker would; ``load``, ``restore`` and
``verify`` (the function and the CLI) must fail at once with a ``CorruptCheckpointError``
naming the step and what is wrong, in bounded time and memory, and a restore of the newest
step falls back past it."""

from __future__ import annotations

import json
import re
import shutil
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.format.bounds import MAX_WORLD_SIZE, PAGE_BYTES_PER_RANK, max_page_ranks
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.pages import encode_page
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify import verify_step
from tests.core._builders import run_cli
from tests.core.test_paged_damage import SHAPES, _save, _values

pytestmark = pytest.mark.timeout(120)

#: What one failed read of a forged step may cost. The old reader derived every cell first:
#: 2^20 cells took ~5 s and ~250 MB, the issue's 2^24 a minute and 4 GB.
SECONDS, PYTHON_BYTES = 10.0, 32 << 20
#: The 17 bytes of a page that claims every rank of the world.
TINY_PAGE = b'{"page_schema":1}'


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of a real 4-rank paged save, each of two pages."""
    root = tmp_path_factory.mktemp("saved")
    _save(root, 1, "0123abcd")
    _save(root, 2, "89abcdef")
    return root


def forge(
    root: Path,
    *,
    world: int,
    mesh: list[int],
    shape: list[int],
    placements: list[list[Any]],
    page_size: int = len(TINY_PAGE),
) -> None:
    """Rewrite step 2 as the issue's attacker did: one uint8 leaf of ``shape`` laid out on a
    mesh of consecutive ranks, one page (its bytes ``TINY_PAGE``, the manifest saying
    ``page_size`` and keeping the old digest) claiming all ``world`` ranks."""
    d = root / step_dir(2)
    m = json.loads((d / "manifest.json").read_text())
    ds, pages = m["described"], m["described"]["pages"]
    page = pages["path"][0]
    (d / page).write_bytes(TINY_PAGE)
    m["world_size"] = world
    m["files"] = {page: {"size_bytes": page_size, "rank": 0}}
    ds.update(keys=["m/x"], kind=["tensor"], dtype=["uint8"], ndim=[len(shape)], shape=shape)
    ds.update(layout=[0], replica=[0], layouts=[[0, placements]], meshes=[{"shape": mesh, "first_rank": 0}])
    ds["pages"] = {
        "path": [page],
        "size": [page_size],
        "digest": [pages["digest"][0]],
        "first": [0],
        "count": [world],
        "files": [0],
        "bytes": [0],
    }
    (d / "manifest.json").write_text(json.dumps(m))


def bounded(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, asserting it took under ``SECONDS`` and allocated under ``PYTHON_BYTES`` of
    Python objects at its peak (the cells, records and lists a reader makes)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert took < SECONDS and peak < PYTHON_BYTES, f"{what}: {took:.1f} s, peak {peak >> 20} MiB"


def fails(what: str, fn: Callable[[], Any], *why: str) -> str:
    """``fn()`` raises a ``CorruptCheckpointError`` naming step 2 and each of ``why``, bounded."""

    def run() -> None:
        with pytest.raises(CorruptCheckpointError) as info:
            fn()
        text = str(info.value)
        assert step_dir(2) in text and "damaged" in text and all(w in text for w in why), text

    bounded(what, run)
    return what


def every_reader_fails_fast(root: Path, capsys: pytest.CaptureFixture[str], shape: list[int], *why: str) -> None:
    """``load``, ``restore`` into a target, ``verify_step`` and ``shardkeeper verify`` of step 2
    fail at once naming ``why``; restoring the newest step falls back to step 1, intact (and
    quarantines step 2: last)."""
    target = {"m": {"x": torch.zeros(shape, dtype=torch.uint8)}}
    with CheckpointManager(str(root)) as mgr:
        fails("load", lambda: mgr.load(2), *why)
        fails("restore", lambda: mgr.restore(target, step=2), *why)
    storage = LocalStorage(root)
    try:  # a manifest that does not validate is raised; a damaged page is a problem of the report
        problems = [p.message for p in bounded("verify_step", lambda: verify_step(storage, 2)).problems]
    except CorruptCheckpointError as e:
        problems = [str(e)]
    assert problems and all(w in "\n".join(problems) for w in why), problems
    code, out, err = bounded("shardkeeper verify", lambda: run_cli(capsys, "verify", "-q", root, 2))
    assert code == 1 and all(w in out + err for w in why), (out, err)
    with CheckpointManager(str(root)) as mgr:
        # the newest step: step 2 is damaged, step 1 (which has no m/x) restores
        both: dict[str, Any] = {"m": {**{k: torch.zeros(s) for k, s in SHAPES.items()}, "x": target["m"]["x"]}}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert bounded("restore newest", lambda: mgr.restore(both, strict=False)) == 1
        assert any(re.search(r"step 2 .* damaged .* falling back", str(w.message)) for w in said), said
        assert all(torch.equal(both["m"][k], v) for k, v in _values().items())


@pytest.fixture()
def root(saved: Path, tmp_path: Path) -> Iterator[Path]:
    copy = tmp_path / "root"
    shutil.copytree(saved, copy)
    yield copy


def test_the_forged_step_of_16_million_ranks_fails_at_once(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's step: 2^24 ranks, a 4096 x 4096 mesh over a 16 MiB leaf, a 17-byte page."""
    forge(root, world=1 << 24, mesh=[4096, 4096], shape=[4096, 4096], placements=[["S", 0], ["S", 1]])
    every_reader_fails_fast(root, capsys, [4096, 4096], "16777216 ranks", str(MAX_WORLD_SIZE))


@pytest.mark.parametrize("world", [MAX_WORLD_SIZE + 1, 1 << 24, (1 << 63) - 1])
def test_a_world_above_the_cap_is_damage(root: Path, world: int) -> None:
    """Nothing else edited: the world's size alone is refused, before any rank is derived."""
    m = json.loads((root / step_dir(2) / "manifest.json").read_text())
    m["world_size"] = world
    (root / step_dir(2) / "manifest.json").write_text(json.dumps(m))
    with CheckpointManager(str(root)) as mgr:
        fails("load", lambda: mgr.load(2), f"world_size {world}", f"the {MAX_WORLD_SIZE} ranks a reader accepts")


def test_a_page_claiming_more_ranks_than_its_bytes_can_list_is_damage(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At the cap, the 17-byte page claims 2^20 ranks: refused when the manifest is checked."""
    forge(root, world=MAX_WORLD_SIZE, mesh=[1024, 1024], shape=[4096, 4096], placements=[["S", 0], ["S", 1]])
    why = f"of 17 bytes claims {MAX_WORLD_SIZE} ranks"
    every_reader_fails_fast(root, capsys, [4096, 4096], why)


def test_the_page_bound_holds_for_every_page_a_writer_writes(saved: Path) -> None:
    """The shortest page of ``n`` ranks (none with an index file, no files) still spends
    ``PAGE_BYTES_PER_RANK`` bytes on each; the real save's pages are within the bound."""
    for n in (1, 2, 3, 10, 128, 1000):
        assert max_page_ranks(len(encode_page(10**12, 10**6, {}, [None] * n, {}))) >= n
    assert len(encode_page(0, 0, {}, [None] * 1000, {})) < PAGE_BYTES_PER_RANK * 1000 + 200  # (a tight bound)
    pages = json.loads((saved / step_dir(1) / "manifest.json").read_text())["described"]["pages"]
    assert all(c <= max_page_ranks(s) for c, s in zip(pages["count"], pages["size"]))


@pytest.mark.parametrize(
    ("shape", "placements"),
    [
        ([4096, 4096], [["S", 0], ["S", 1]]),  # 2^20 cells, a product of two dimensions
        ([1 << 24], [["S", 0], ["S", 0]]),  # 2^20 parts of one dimension, two splits nested
    ],
)
def test_cells_come_one_at_a_time_so_the_first_unbacked_one_fails(
    root: Path, capsys: pytest.CaptureFixture[str], shape: list[int], placements: list[list[Any]]
) -> None:
    """The page's recorded size backs its 2^20 ranks (the manifest validates); its bytes are
    17. The reader reads rank 0's page at the first cell and fails there, having derived one
    cell, not 2^20 first."""
    size = PAGE_BYTES_PER_RANK * MAX_WORLD_SIZE
    forge(root, world=MAX_WORLD_SIZE, mesh=[1024, 1024], shape=shape, placements=placements, page_size=size)
    every_reader_fails_fast(root, capsys, shape, "(the records of ranks 0 to 1048575) does not match the size")
