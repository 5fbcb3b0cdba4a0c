"""Damage to a group-commit step (the ranks' records in pages, format.md 3.9) as the tools
that act on damage meet it, on a real 4-rank step of 2 groups built in one process through
the real index writer, ``fold_group``, ``unfold``, ``assemble_manifest`` and
``commit_manifest``: ``delete(step, damaged=True)`` deletes a step whose only damage is a page
or an index file, and deletes nothing while another committed step's page cannot be read
(its references are unknown); a page the reader would refuse fails the save at its leader;
``verify`` never walks the ranks a damaged page claims one by one; a page's rank range is
made of integers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from shardkeeper.core import CheckpointManager
from shardkeeper.core.commit.merge import assemble_manifest, declared_digest
from shardkeeper.core.commit.protocol import RankReport, Timings
from shardkeeper.core.commit.put import commit_manifest
from shardkeeper.core.errors import CheckpointSaveError, CorruptCheckpointError
from shardkeeper.core.format.bounds import MAX_WORLD_SIZE, PAGE_BYTES_PER_RANK
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.digest import block_digests
from shardkeeper.core.format.grid import Mesh, Rule, cell_box
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.pages import parse_page
from shardkeeper.core.format.safetensors import build_header, chunk_name
from shardkeeper.core.format.table import rows_report
from shardkeeper.core.save.group import fold_group, unfold
from shardkeeper.core.save.index_write import write_index
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.step import verify_step

pytestmark = pytest.mark.timeout(120)

WORLD, BLOCK = 4, 4096
SHAPES = {"a": (8, 6), "c": (64, 32)}
MESH = Mesh((WORLD,), tuple(range(WORLD)))
RULES = {f"m/{k}": Rule(MESH, (("S", 0),), 0) for k in SHAPES}
BASE_ATTEMPT = "0123abcd"  # the attempt of the step an incremental save points at
DECLARED = {f"m/{k}": ["tensor", "float32", list(s)] for k, s in SHAPES.items()}


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def _rank_report(storage: LocalStorage, step: int, attempt: str, r: int, base: int | None) -> RankReport:
    """Rank ``r``'s data file and index file, and its report of them. ``base``: an incremental
    save of unchanged values, whose rows all point at the data file rank ``r`` wrote for step
    ``base`` (saved by ``_save(root, base, BASE_ATTEMPT)``), and which writes none."""
    vals, coord = _values(), MESH.coordinate(r)
    rel = f"data/r{r:05d}-{attempt if base is None else BASE_ATTEMPT}-000.safetensors"
    keys, parts, entries, boxes = [], [], [], []
    for k, s in SHAPES.items():
        offs, box = cell_box(s, MESH, RULES[f"m/{k}"].placements, coord)
        data = vals[k][offs[0] : offs[0] + box[0]].contiguous().numpy().tobytes()
        keys.append(f"m/{k}")
        parts.append(data)
        boxes.append((offs, box))
        entries.append((chunk_name(f"m/{k}", offs, box, s), "float32", box, len(data)))
    header, at = build_header(entries, {"format": "pt"})
    blob = bytearray(header)
    for data, off in zip(parts, at):
        blob += bytes(off - len(blob)) + data
    if base is None:
        storage.put(f"{step_dir(step)}/{rel}", bytes(blob))
    path = rel if base is None else f"../{step_dir(base)}/{rel}"
    table = ChunkTable(
        [path],
        [0] * len(keys),
        list(at),
        [len(d) for d in parts],
        [2] * len(keys),
        [v for offs, _ in boxes for v in offs],
        [v for _, box in boxes for v in box],
        [",".join(block_digests(memoryview(d), "xxh3_128", BLOCK)) for d in parts],
        {},
        0,
    )
    index, size, digest, ends = write_index(storage, step_dir(step), step, r, attempt, keys, table, "xxh3_128")
    files = {index: {"size_bytes": size, "rank": r}}
    if base is None:
        files[rel] = {"size_bytes": len(blob), "rank": r}
    return RankReport(
        rank=r,
        attempt=attempt,
        declared=DECLARED if r == 0 else {},
        declared_digest=declared_digest(DECLARED),
        chunks=rows_report([], ChunkTable([], [], [], [], [], [], [], [], {}, 0)),
        files=files,
        objects={},
        bases=[] if base is None else [base],
        extended=False,
        per_rank_prefixes=[],
        layouts=[],
        timings=Timings(),
        described={"digest": "d", "index": [index, size, digest], "chunk_files": ends},
    )


def _save(
    root: Path, step: int, attempt: str, *, base: int | None = None, edit: Callable[[list[Any]], None] | None = None
) -> None:
    """A group commit of ``step``: two leaders fold two ranks each, the coordinator commits."""
    storage = LocalStorage(root)
    reports = [_rank_report(storage, step, attempt, r, base) for r in range(WORLD)]
    if edit is not None:
        edit(reports)
    with ThreadPoolExecutor(2) as io:
        leaders = []
        for first in (0, 2):
            folded, written = fold_group(
                storage, step_dir(step), step, attempt, reports[first : first + 2], algorithm="xxh3_128", executor=io
            )
            if written is not None:
                written.result()
            leaders.append(folded)
        got, pages, refs = unfold(leaders)
        m = assemble_manifest(
            step,
            attempt,
            [rep.members() for rep in got],
            world_size=WORLD,
            digest="xxh3_128",
            block_bytes=BLOCK,
            metadata={},
            described=RULES,
            pages=pages,
        )
        bases = [] if base is None else [base]
        commit_manifest(storage, step, m, m.dumps(), bases=bases, references=refs, executor=io)


def _manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "manifest.json").read_text())


def _page(root: Path, step: int, p: int) -> Path:
    return root / step_dir(step) / _manifest(root, step)["described"]["pages"]["path"][p]


def _flip(path: Path, at: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _restored(root: Path, step: int) -> dict[str, torch.Tensor]:
    target = {"m": {k: torch.zeros(s) for k, s in SHAPES.items()}}
    with CheckpointManager(str(root)) as mgr:
        mgr.restore(target, step=step)
    return target["m"]


def _kinds(root: Path, step: int) -> set[str]:
    return {p.kind for p in verify_step(LocalStorage(root), step).problems}


@pytest.mark.parametrize("damaged", ["page", "index"])
def test_a_newest_step_whose_only_damage_is_a_page_or_an_index_file_is_deleted(tmp_path: Path, damaged: str) -> None:
    _save(tmp_path, 1, "0123abcd")
    _save(tmp_path, 2, "89abcdef")
    assert all(torch.equal(v, _values()[k]) for k, v in _restored(tmp_path, 2).items())
    if damaged == "page":
        _flip(_page(tmp_path, 2, 1))
    else:
        _flip(tmp_path / step_dir(2) / "data" / "r00003-89abcdef.index.json", 20)
    with pytest.raises(CorruptCheckpointError):
        _restored(tmp_path, 2)
    assert damaged in _kinds(tmp_path, 2)
    with CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.delete(2, damaged=True) is True
        assert mgr.steps() == [1]
    assert not (tmp_path / step_dir(2)).exists()
    assert all(torch.equal(v, _values()[k]) for k, v in _restored(tmp_path, 1).items())


def test_nothing_is_deleted_while_another_committed_steps_page_cannot_be_read(tmp_path: Path) -> None:
    """Step 2 (incremental) points at step 1's data files through its pages; one page of step 2
    is damaged and step 1 has a damaged data file. Deleting step 1 would take files step 2's
    intact page needs: it is refused, naming step 2 and the order that works."""
    _save(tmp_path, 1, "0123abcd")
    _save(tmp_path, 2, "4567cdef", base=1)
    _save(tmp_path, 3, "89abcdef")
    _flip(tmp_path / step_dir(1) / "data" / "r00003-0123abcd-000.safetensors", -1)
    page = _page(tmp_path, 2, 1)
    _flip(page)
    before = sorted(p.name for p in (tmp_path / step_dir(1) / "data").iterdir())
    with CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ValueError, match=r"committed step 2 references files that cannot all be read") as info:
            mgr.delete(1, damaged=True)
        assert (
            "nothing was deleted" in str(info.value)
            and "delete" in str(info.value)
            and " 2 --damaged" in str(info.value)
        )
        assert mgr.steps() == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / step_dir(1) / "data").iterdir()) == before
    _flip(page)  # the page put back (another tier's copy): step 2's intact half still reads
    assert _kinds(tmp_path, 2) == {"digest"}  # only the rank whose step-1 file was damaged
    # the order the error gives works: step 2 (damaged page) first, then step 1
    _flip(page)
    with CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.delete(2, damaged=True) is True
        assert mgr.delete(1, damaged=True) is True
        assert mgr.steps() == [3]


def test_a_page_the_reader_would_refuse_fails_the_save_at_its_leader(tmp_path: Path) -> None:
    """A rank whose chunk_files end lies past its file (a writer's bug): the leader's page
    would be refused by every restore, so the save fails before anything is committed."""

    def past_the_end(reports: list[Any]) -> None:
        ends = reports[3].described["chunk_files"]
        ends[0][1] += 100

    with pytest.raises(CheckpointSaveError, match=r"page of ranks 2 to 3 .* refused by the reader .* nothing was"):
        _save(tmp_path, 1, "0123abcd", edit=past_the_end)
    assert not (tmp_path / step_dir(1) / "manifest.json").exists()


def test_verify_does_not_walk_the_ranks_a_damaged_page_claims(tmp_path: Path) -> None:
    _save(tmp_path, 1, "0123abcd")
    m = _manifest(tmp_path, 1)
    claimed = MAX_WORLD_SIZE - 2  # the page itself says 2: damage, said once
    page = _page(tmp_path, 1, 1)  # padded to the bytes that many ranks need, so the manifest validates
    padded = page.read_bytes().ljust(claimed * PAGE_BYTES_PER_RANK)
    page.write_bytes(padded)
    pages = m["described"]["pages"]
    pages["count"][1], pages["size"][1], pages["digest"][1] = claimed, len(padded), xxhash.xxh3_128_hexdigest(padded)
    m["world_size"], m["files"][pages["path"][1]]["size_bytes"] = MAX_WORLD_SIZE, len(padded)
    (tmp_path / step_dir(1) / "manifest.json").write_text(json.dumps(m))
    t0 = time.monotonic()
    problems = verify_step(LocalStorage(tmp_path), 1).problems
    assert time.monotonic() - t0 < 10, "verify walked the claimed ranks one by one"
    assert problems and {p.kind for p in problems} <= {"page", "index"}, problems
    assert any("says it holds ranks from 2, 2 of them" in p.message for p in problems)


@pytest.mark.parametrize("member, value", [("first", False), ("first", 2.0), ("count", 2.0), ("count", True)])
def test_a_pages_rank_range_must_be_integers(tmp_path: Path, member: str, value: object) -> None:
    """true, false and 2.0 are no ranks, though Python compares them equal to 1, 0 and 2: a page
    saying so is refused for its range (the one asked for is the value's integer)."""
    _save(tmp_path, 1, "0123abcd")
    doc = json.loads(_page(tmp_path, 1, 0).read_bytes())  # ranks 0 and 1
    assert parse_page(json.dumps(doc).encode(), step=1, first=0, count=2).first == 0
    doc[member] = value
    asked = {"first": 0, "count": 2, member: int(value)}  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="says it holds ranks from"):
        parse_page(json.dumps(doc).encode(), step=1, **asked)
