"""Bounded work on a hostile described step (docs/format.md 3.8, 3.9 and 12): a manifest of a
kilobyte that claims millions of ranks costs a reader what the step's files back, not what the
manifest claims. Each step is a real group-commit save (``test_paged_damage``'s ``_save``:
the real index writer, ``fold_group``, ``assemble_manifest``, ``commit_manifest``) whose
manifest and first page are then rewritten as an attacker would; ``load``, ``restore`` and
``verify`` (the function and the CLI) must fail at once with a ``CorruptCheckpointError``
naming the step and what is wrong, in bounded time and memory, and a restore of the newest
step falls back past it. A target-free ``load()`` sizes its tensors from the manifest: a leaf
of a tebibyte that the step's files cannot back fails before anything is allocated, and one
they back that the machine cannot allocate is a named error, not torch's."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CheckpointRestoreError, CorruptCheckpointError
from shardkeeper.core.format.bounds import (
    MAX_WORLD_SIZE,
    PAGE_BYTES_PER_RANK,
    ZSTD_FRAME_MIN_BYTES,
    ZSTD_MAX_EXPANSION,
    max_page_ranks,
)
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.pages import encode_page
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.step import verify_step
from tests.core._builders import run_cli
from tests.core.format.test_paged_damage import SHAPES, _save, _values

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


# -- leaves the step's files cannot back (load() sizes its tensors from the manifest) ----------

#: A uint8 leaf of 1 TiB, and the fewest stored bytes of one zstd chunk that may decode to it.
TIB = [1 << 20, 1 << 20]
TIB_BYTES = 1 << 40
ZSTD_LEN = TIB_BYTES // ZSTD_MAX_EXPANSION + ZSTD_FRAME_MIN_BYTES


@pytest.mark.parametrize(("world", "mesh"), [(4, [2, 2]), (MAX_WORLD_SIZE, [1024, 1024])])
def test_a_described_leaf_of_a_tebibyte_fails_before_allocating(root: Path, world: int, mesh: list[int]) -> None:
    """A page whose recorded size backs its ranks: the manifest validates, and the leaf's
    chunks, read from that page before the leaf is allocated, fail it (not torch's allocator)."""
    forge(root, world=world, mesh=mesh, shape=TIB, placements=[["S", 0], ["S", 1]], page_size=10 * world)
    why = f"(the records of ranks 0 to {world - 1}) does not match the size"
    with CheckpointManager(str(root)) as mgr:
        fails("load", lambda: mgr.load(2), why)
        fails("load newest", lambda: mgr.load(), why)  # load() does not fall back: it names the damage


def _plain(root: Path) -> None:
    """Steps 1 and 2 of a plain one-rank save (chunks listed in the manifest)."""
    with CheckpointManager(str(root)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"m": {"x": torch.ones(4, 4, dtype=torch.uint8), "y": torch.ones(8)}}, async_save=False)


def forge_tebibytes(root: Path, keys: list[str], *, backed: bool) -> Path:
    """Rewrite step 2's ``keys`` as 1 TiB uint8 leaves, each one zstd chunk of ``ZSTD_LEN``
    stored bytes (the fewest that may decode to it) at offset 0 of step 1's data file, by
    reference (section 5.3: a file of another step, which the manifest's checks cannot size),
    which ``backed`` extends (sparse) to those bytes. Returns that file."""
    (file,) = json.loads((root / step_dir(1) / "manifest.json").read_text())["files"]
    d = root / step_dir(2)
    m = json.loads((d / "manifest.json").read_text())
    m.pop("logical", None)  # (sums of the values the forger replaced)
    digests = ",".join(["0" * 32] * -(-ZSTD_LEN // m["digest_block_bytes"]))
    chunk = {"file": f"../{step_dir(1)}/{file}", "offset": 0, "length": ZSTD_LEN, "offsets": [0, 0], "shape": TIB}
    for key in keys:
        m["leaves"][key] = {
            "kind": "tensor",
            "dtype": "uint8",
            "shape": TIB,
            "chunks": [{**chunk, "digests": digests, "encoding": "zstd"}],
        }
    (d / "manifest.json").write_text(json.dumps(m))
    if backed:
        os.truncate(root / step_dir(1) / file, ZSTD_LEN)
    return root / step_dir(1) / file


def test_a_leaf_its_file_cannot_hold_fails_before_allocating(tmp_path: Path) -> None:
    """The manifest validates (a zstd frame of ``ZSTD_LEN`` bytes may decode to 1 TiB), but
    the data file it names is a few hundred bytes: refused naming the leaf and the sizes, nothing
    allocated (before: torch's raw ``RuntimeError: DefaultCPUAllocator``)."""
    _plain(tmp_path)
    size = forge_tebibytes(tmp_path, ["m/x"], backed=False).stat().st_size
    why = ("'m/x'", f"uint8 {TIB}", f"{TIB_BYTES} bytes", f"is {size} bytes, shorter than the {ZSTD_LEN}")
    with CheckpointManager(str(tmp_path)) as mgr:
        fails("load", lambda: mgr.load(2), *why)
        fails("load newest", lambda: mgr.load(), *why)
        assert mgr.load(2, only="m/y")["m"]["y"].equal(torch.ones(8))  # the rest of the step loads


def test_leaves_sharing_stored_bytes_fail_before_allocating(tmp_path: Path) -> None:
    """Each of two 1 TiB leaves is backed by the file alone, both by the same bytes: together
    they claim twice what the file holds (no writer stores a byte for two chunks)."""
    _plain(tmp_path)
    forge_tebibytes(tmp_path, ["m/x", "m/y"], backed=True)
    why = ("'m/y'", f"claim {2 * ZSTD_LEN} stored bytes, more than the {ZSTD_LEN}", "share stored bytes")
    with CheckpointManager(str(tmp_path)) as mgr:
        fails("load", lambda: mgr.load(2), *why)


@contextmanager
def address_space(extra: int) -> Iterator[None]:
    """This process may map at most ``extra`` more bytes (RLIMIT_AS), whatever the machine's
    memory and overcommit policy: an allocation above that fails for real."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    status = Path("/proc/self/status").read_text()
    now = int(re.search(r"VmSize:\s+(\d+) kB", status)[1]) << 10  # type: ignore[index]
    resource.setrlimit(
        resource.RLIMIT_AS, (now + extra if hard == resource.RLIM_INFINITY else min(now + extra, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space's size from /proc")
def test_a_backed_leaf_this_machine_cannot_allocate_is_a_named_error(tmp_path: Path) -> None:
    """The file holds what the chunk may decode to, so the step is not damage: an allocation
    that fails is a ``CheckpointRestoreError`` naming the leaf, its size and the remedy, not
    torch's raw ``RuntimeError``, and not damage."""
    _plain(tmp_path)
    forge_tebibytes(tmp_path, ["m/x"], backed=True)
    with CheckpointManager(str(tmp_path)) as mgr, address_space(32 << 30):
        with pytest.raises(CheckpointRestoreError) as info:
            mgr.load(2)
    text = str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError) and isinstance(info.value.__cause__, RuntimeError)
    assert all(w in text for w in ("'m/x'", f"{TIB_BYTES} bytes", "cannot allocate", "only=", str(tmp_path))), text
