"""Described leaves (docs/format.md 3.8) as a reader meets them, without a process group: a
4-rank checkpoint written file by file as the ranks write it (data files, index files, the
coordinator's merge), restored whole in one process, and every edit a reader must refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.commit.committed import load_manifest, manifest_path
from shardkeeper.core.commit.merge import assemble_manifest, declared_digest
from shardkeeper.core.format.columns import ChunkTable
from shardkeeper.core.format.digest import block_digests
from shardkeeper.core.format.grid import Mesh, Rule, cell_box
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.safetensors import build_header, chunk_name
from shardkeeper.core.save.index_write import write_index
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.step import verify_step

W, BLOCK = 4, 4096
# keys m/a ... m/e; b: fewer rows than ranks; a, d and e split alike, so a reader takes their
# rows of one rank in one batch (format/index_rows.py)
SHAPES = {"a": (10, 6), "b": (3, 5), "c": (64, 32), "d": (10, 6), "e": (10, 6)}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def _report(
    storage: LocalStorage, r: int, declared: dict, rel: str, nbytes: int, keys: list, table: ChunkTable
) -> dict:
    """Rank ``r``'s index file written, and its report as the coordinator merges it: the shard
    file ``rel`` of ``nbytes``, every chunk described (rank 0 declares every leaf)."""
    path, size, digest, files = write_index(storage, step_dir(1), 1, r, f"0000000{r}", keys, table, "xxh3_128")
    return {
        "rank": r,
        "declared": declared if r == 0 else {},
        "declared_digest": declared_digest(declared),
        "chunks": {"keys": [], "counts": [], "table": ChunkTable([], [], [], [], [], [], [], [], {}, 0)},
        "files": {rel: {"size_bytes": nbytes, "rank": r}, path: {"size_bytes": size, "rank": r}},
        "objects": {},
        "per_rank_prefixes": [],
        "described": {"digest": "d", "index": [path, size, digest], "chunk_files": files},
    }


def _write(root: Path, mesh_ranks: tuple[int, ...] = (0, 1, 2, 3)) -> LocalStorage:
    """Step 1 of a checkpoint whose tensors are row-sharded over a mesh of ``mesh_ranks``."""
    storage = LocalStorage(root)
    full = _full()
    mesh = Mesh((W,), mesh_ranks)
    rules = {f"m/{k}": Rule(mesh, (("S", 0),), 0) for k in SHAPES}
    declared = {f"m/{k}": ["tensor", "float32", list(s)] for k, s in SHAPES.items()}
    reports = []
    for r in range(W):
        coord = mesh.coordinate(r)
        rel = f"data/r{r:05d}-0000000{r}-000.safetensors"
        keys, rows, parts, entries = [], [], [], []
        for k, s in SHAPES.items():
            offs, box = cell_box(s, mesh, rules[f"m/{k}"].placements, coord)
            if 0 in box:
                continue
            b = full[k][offs[0] : offs[0] + box[0]].contiguous().numpy().tobytes()
            keys.append(f"m/{k}")
            parts.append(b)
            entries.append((chunk_name(f"m/{k}", offs, box, s), "float32", box, len(b)))
        header, at = build_header(entries, {"format": "pt"})  # a safetensors file, as a rank writes it
        data = bytearray(header)
        for b, off in zip(parts, at):
            data += bytes(off - len(data)) + b
        for k, b, off, (_, _, box, _) in zip(keys, parts, at, entries):
            offs = cell_box(SHAPES[k[2:]], mesh, rules[k].placements, coord)[0]
            rows.append((off, len(b), offs, box, ",".join(block_digests(memoryview(b), "xxh3_128", BLOCK))))
        storage.put(f"{step_dir(1)}/{rel}", bytes(data))
        table = ChunkTable(
            [rel],
            [0] * len(rows),
            [o for o, *_ in rows],
            [n for _, n, *_ in rows],
            [2] * len(rows),
            [v for *_, offs, _, _ in rows for v in offs],
            [v for *_, box, _ in rows for v in box],
            [d for *_, d in rows],
            {},
            0,
        )
        reports.append(_report(storage, r, declared, rel, len(data), keys, table))
    m = assemble_manifest(
        1, "t", reports, world_size=W, digest="xxh3_128", block_bytes=BLOCK, metadata={}, described=rules
    )
    storage.put_if_absent(manifest_path(1), m.dumps())
    return storage


def _restore(root: Path) -> dict[str, torch.Tensor]:
    target = {"m": {k: torch.zeros(s) for k, s in SHAPES.items()}}
    with CheckpointManager(str(root)) as mgr:
        mgr.restore(target, step=1)
    return target["m"]


def test_a_described_checkpoint_restores_whole_in_one_process(tmp_path: Path) -> None:
    _write(tmp_path, mesh_ranks=(2, 0, 3, 1))  # coordinates need not be ranks in order
    got, want = _restore(tmp_path), _full()
    assert all(torch.equal(got[k], want[k]) for k in SHAPES)
    man = json.loads((tmp_path / step_dir(1) / "manifest.json").read_text())
    assert (
        man["format_version"] == 1
        and man["requires"] == ["described"]
        and man["described"]["keys"] == [f"m/{k}" for k in sorted(SHAPES)]
    )
    assert man["leaf_table"]["keys"] == [] and man["described"]["meshes"][0]["ranks"] == [2, 0, 3, 1]
    assert not verify_step(LocalStorage(tmp_path), 1).problems


def test_a_rank_reads_only_the_index_files_of_the_boxes_it_needs(tmp_path: Path) -> None:
    storage = _write(tmp_path)
    m = load_manifest(storage, 1)
    leaves = m.leaves
    chunks = leaves.overlapping("m/c", (16, 0), (16, 32))  # rank 1's rows, exactly
    assert [(c.offsets, c.shape) for c in chunks] == [((16, 0), (16, 32))]
    assert leaves.described.index_reads == 1
    leaves.overlapping("m/c", (10, 0), (20, 32))  # rows 10-29: ranks 0 and 1 (1 already read)
    assert leaves.described.index_reads == 2
    assert len(m.leaves["m/b"].chunks) == 3 and leaves.described.index_reads == 3  # b has no 4th row


def test_a_batch_of_boxes_finds_what_each_box_finds_alone(tmp_path: Path) -> None:
    """Restore planning asks for every piece's chunks in one batch (leaves split alike share
    their cells and their rows are checked together); each box gets what it gets alone, the
    described leaves' and the enumerated ones' of one manifest alike."""
    from shardkeeper.core.format.reports import decode_report
    from shardkeeper.core.format.table import LeafTable, TableLeaves

    storage = _write(tmp_path)
    boxes = [
        ("m/a", (3, 0), (3, 6)),  # rank 1's box; m/d and m/e at it: one batch of rank 1's rows
        ("m/d", (3, 0), (3, 6)),
        ("m/e", (0, 0), (10, 6)),  # the whole leaf: four ranks' rows
        ("v", (2,), (4,)),  # an enumerated leaf, between described ones
        ("m/c", (10, 0), (20, 32)),  # across ranks 0 and 1
        ("m/b", (0,), (3,)),  # a box of other dimensions: none
        ("m/e", (3, 0), (3, 6)),
        ("m/a", (0, 2), (10, 2)),  # two columns of every rank's rows
        ("m/a", (0, 0), (0, 6)),  # an empty box: none
    ]
    rows = [{"file": "data/v", "offset": 64 * i, "length": 12, "offsets": [3 * i], "shape": [3]} for i in range(3)]
    table = ChunkTable.concat([decode_report({"v": [{**r, "digests": "a" * 32} for r in rows]}, 32)[0]], 32)
    enumerated = LeafTable(["v"], ["tensor"], ["float32"], [1], [9], [3], [0, 1, 2])

    def leaves() -> TableLeaves:  # a fresh reader each time: nothing made before
        described = load_manifest(storage, 1).leaves.described
        return TableLeaves({}, enumerated, table, BLOCK, described=described)

    batch, alone = leaves().overlapping_many(boxes), [leaves().overlapping(*b) for b in boxes]
    assert batch == alone
    assert [len(found) for found in batch] == [1, 1, 4, 2, 2, 0, 1, 4, 0]
    assert [(c.offsets, c.shape) for c in batch[1]] == [((3, 0), (3, 6))]
    assert [c.offsets for c in batch[3]] == [(0,), (3,)]


@pytest.mark.parametrize("max_read", [256, 4096, 64 << 20])
def test_the_planned_reads_serve_every_piece_once(tmp_path: Path, max_read: int) -> None:
    """Pieces of every kind (a whole chunk, part of one, across ranks, columns) become ops as
    the general overlap gives them, and the coalesced reads serve each op from exactly one
    block-aligned segment of its chunk, in file order, none of several segments above
    ``max_read``."""
    import random

    from shardkeeper.core.restore.plan import overlap_ops, piece_ops
    from shardkeeper.core.restore.reads import plan_reads
    from shardkeeper.core.state.chunks import Piece

    storage = _write(tmp_path)
    leaves = load_manifest(storage, 1).leaves
    rnd = random.Random(max_read)
    wanted = []
    for _ in range(40):
        k = rnd.choice(sorted(SHAPES))
        rows, cols = SHAPES[k]
        r0, c0 = rnd.randrange(rows), rnd.randrange(cols)
        n, m = rnd.randint(1, rows - r0), rnd.randint(1, cols - c0)
        if rnd.random() < 0.3:  # a rank's own box of a row-sharded leaf, exactly
            per = -(-rows // W)
            r0, n, c0, m = per * (r0 // per), min(per, rows - per * (r0 // per)), 0, cols
        wanted.append((f"m/{k}", f"m/{k}", Piece((r0, c0), (n, m), torch.zeros(n, m)), torch.float32, 4))
    ops = piece_ops(leaves, wanted, max_read)
    general = [
        op
        for key, _, piece, dtype, isz in wanted
        for c in leaves.overlapping(key, piece.offsets, piece.shape)
        for op in overlap_ops(key, piece, c, dtype, isz, max_read)
    ]
    fields = [(o.key, o.chunk, o.rel_lo, o.rel_shape, o.start, o.end, o.dest.data_ptr()) for o in ops]
    assert fields == [(o.key, o.chunk, o.rel_lo, o.rel_shape, o.start, o.end, o.dest.data_ptr()) for o in general]
    reads = plan_reads(ops, BLOCK, max_read)
    served = [id(op) for rd in reads for seg in rd.segments for op in seg.ops]
    assert sorted(served) == sorted(map(id, ops))  # every op once
    assert [(rd.file, rd.start) for rd in reads] == sorted((rd.file, rd.start) for rd in reads)
    for rd in reads:
        assert len(rd.segments) == 1 or rd.end - rd.start <= max_read
        for seg in rd.segments:
            c = seg.chunk
            assert seg.start % BLOCK == 0 and (seg.end % BLOCK == 0 or seg.end == c.length)
            assert rd.start <= c.offset + seg.start and c.offset + seg.end <= rd.end
            assert all(seg.start <= op.start and op.end <= seg.end and op.chunk == c for op in seg.ops)


def _edit(root: Path, fn) -> None:  # type: ignore[no-untyped-def]
    p = root / step_dir(1) / "manifest.json"
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda d: d.pop("requires"), "has the member described but does not require 'described'"),
        (lambda d: d.pop("described"), "requires 'described' but has no member described"),
        (lambda d: d["described"]["meshes"][0].update(ranks=[0, 0, 1, 2]), "not distinct ranks"),
        (lambda d: d["described"]["meshes"][0].update(ranks=[0, 1, 2, 9]), "not distinct ranks"),
        (lambda d: d["described"]["meshes"][0].update(shape=[3]), "lists 4 ranks"),
        (lambda d: d["described"]["layouts"][0].__setitem__(1, [["S", 2]]), "neither"),
        (lambda d: d["described"]["layouts"][0].append([1]), "not a permutation"),
        (lambda d: d["described"]["replica"].__setitem__(0, 1), "replica 1 of a layout with 1 replicas"),
        (lambda d: d["described"]["layout"].__setitem__(0, 5), "layout 5 is not one of"),
        (lambda d: d["described"]["index"]["digest"].pop(), "list 4, 4, 3 ranks, not 4"),
        (lambda d: d["described"]["index"]["path"].pop(), "list 3, 4, 4 ranks, not 4"),
        (lambda d: d["described"]["index"]["size"].__setitem__(1, 7), "not listed in files with its size"),
        (lambda d: d["described"]["index"]["path"].__setitem__(1, "../../x"), "is not a file of its step"),
        (lambda d: d["described"]["chunk_files"]["end"].__setitem__(0, 10**6), "reach byte 1000000"),
        (lambda d: d["described"]["chunk_files"]["path"].__setitem__(0, "/etc/passwd"), "not a path inside the root"),
        (lambda d: d["described"]["chunk_files"]["path"].__setitem__(0, "pages/g00000-x.index.json"), "to a data file"),
        (lambda d: d["described"]["dtype"].__setitem__(0, "complex64"), "known dtype"),
        (lambda d: d["leaf_table"]["keys"].append("m/a"), "leaf_table columns differ"),
        (lambda d: d["described"]["meshes"][0].update(shape=[4] + [1] * 20, ranks=[0, 1, 2, 3]), "at most 16"),
        (lambda d: d["described"]["index"]["path"].__setitem__(2, None), "a rank without an index file has"),
        (lambda d: d["described"]["layouts"][0].__setitem__(1, [["F", 0]]), "not the only placement"),
        (lambda d: d["described"]["layouts"][0].__setitem__(1, [["F", 0, 1]]), "cannot hold"),
        # pages the manifest does not require; a mesh by its first rank
        (lambda d: d["described"].update(pages={}), "has the member described.pages but does not require 'pages'"),
        (lambda d: d.update(requires=["described", "pages"]), "requires 'pages' but has no member described.pages"),
        (lambda d: d["described"]["meshes"][0].update(first_rank=1), "or it lists ranks too"),
        (
            lambda d: (
                d["described"]["meshes"][0].pop("ranks") and None or d["described"]["meshes"][0].update(first_rank=1)
            ),
            "ranks from 1 are not 4 ranks of the world of 4",
        ),
        (  # 16 million ranks by a first rank: refused without making them
            lambda d: d["described"]["meshes"].__setitem__(0, {"shape": [4096, 4096], "first_rank": 0}),
            "has 16777216 ranks, more than a world's 1048576",
        ),
        (  # as many as the largest world, but not of this one
            lambda d: d["described"]["meshes"].__setitem__(0, {"shape": [1024, 1024], "first_rank": 0}),
            "are not 1048576 ranks of the world of 4",
        ),
    ],
)
def test_edits_of_the_described_member_are_damage(tmp_path: Path, edit, why: str) -> None:  # type: ignore[no-untyped-def]
    storage = _write(tmp_path)
    _edit(tmp_path, edit)
    with pytest.raises(CorruptCheckpointError, match="damaged") as e:
        load_manifest(storage, 1)
    assert why in str(e.value), str(e.value)


def _edit_index(root: Path, rank: int, fn, *, keep_digest: bool = True) -> None:  # type: ignore[no-untyped-def]
    """Edit rank ``rank``'s index file; with ``keep_digest`` the manifest is edited to match
    (what a writer bug, not a torn file, would produce)."""
    from shardkeeper.core.format.digest import digest_function

    (p,) = (root / step_dir(1) / "data").glob(f"r{rank:05d}-*.index.json")
    doc = json.loads(p.read_text())
    fn(doc)
    data = json.dumps(doc).encode()
    p.write_bytes(data)
    if keep_digest:
        rel = f"data/{p.name}"

        def fix(d):  # type: ignore[no-untyped-def]
            idx = d["described"]["index"]
            idx["path"][rank], idx["size"][rank], idx["digest"][rank] = (
                rel,
                len(data),
                digest_function("xxh3_128")(data),
            )
            d["files"][rel]["size_bytes"] = len(data)

        _edit(root, fix)


@pytest.mark.parametrize(
    "edit,why",
    [
        (
            lambda d: d["table"]["offsets"].__setitem__(0, 1),
            "gives 'm/a' the box [1, 0]+[3, 6], its layout [3, 0]+[3, 6]",
        ),
        (lambda d: d.update(rank=3), "says it is rank 3's"),
        (lambda d: d.update(rank=True), "says it is rank True's"),
        (lambda d: d.update(step=99), "says it is of step 99"),
        (lambda d: d.update(index_schema=2), "has index_schema 2, not 1"),
        (lambda d: d["keys"].__setitem__(2, d["keys"][0]), "lists the rows of 'm/a' apart"),
        (lambda d: d["keys"].__setitem__(1, d["keys"][0]), "has no chunk of 'm/b'"),  # a run of m/a rows
        (lambda d: d["keys"].__setitem__(1, 7), "lists a key that is not a string"),
        (lambda d: d["table"]["length"].__setitem__(0, 8), "has 8 bytes for a box of 72"),
        (
            lambda d: d["table"]["offset"].__setitem__(2, 10**5),
            "beyond the end that file has in the chunk_files of the manifest",
        ),
        (lambda d: d["table"].update(digests=d["table"]["digests"][:-1]), "hex digits"),
        # rows of a batch (m/a, m/d, m/e): one bad row among good ones is named
        (lambda d: d["table"]["length"].__setitem__(4, 8), "chunk of 'm/e' has 8 bytes for a box of 72"),
        (lambda d: d["table"]["shape"].__setitem__(7, 5), "gives 'm/d' the box [3, 0]+[3, 5], its layout"),
        (
            lambda d: d["table"]["offset"].__setitem__(3, 10**5),
            "chunk of 'm/d' points at",
        ),
        (
            lambda d: d["table"].update(extras={"encoding": [None, None, None, "zstd", None]}),
            "chunk of 'm/d' with encoding 'zstd' has 72 stored bytes, not fewer than its box's 72",
        ),
    ],
)
def test_a_wrong_index_file_is_damage_naming_its_rank(tmp_path: Path, edit, why: str) -> None:  # type: ignore[no-untyped-def]
    _write(tmp_path)
    _edit_index(tmp_path, 1, edit)
    with pytest.raises(CorruptCheckpointError, match="of rank 1") as e:
        _restore(tmp_path)
    assert why in str(e.value) and "restore another step" in str(e.value), str(e.value)


def test_a_torn_index_file_fails_its_digest(tmp_path: Path) -> None:
    _write(tmp_path)
    _edit_index(tmp_path, 2, lambda d: d["table"]["offset"].__setitem__(0, 0), keep_digest=False)
    with pytest.raises(CorruptCheckpointError, match="of rank 2 does not match the size and digest"):
        _restore(tmp_path)
    problems = [p.message for p in verify_step(LocalStorage(tmp_path), 1).problems]
    assert any("index file" in p and "of rank 2" in p for p in problems), problems
    assert all("r00002-" in p for p in problems), problems  # its size too; nothing else


def test_a_partial_restore_reads_only_its_keys_index_files(tmp_path: Path) -> None:
    _write(tmp_path)
    target = {"m": {"b": torch.zeros(3, 5)}}
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(target, step=1, only=["m/b"])
        stats = mgr.last_restore_stats
    assert torch.equal(target["m"]["b"], _full()["b"])
    assert stats.index_files == 3  # b's three rows lie with ranks 0-2; rank 3 wrote none of it


def test_export_of_a_described_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardkeeper.core.tools.export import export_safetensors

    _write(tmp_path / "root")
    export_safetensors(str(tmp_path / "root"), 1, to=str(tmp_path / "out"), keys=["m/*"], keep_prefix=True)
    got = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    want = _full()
    assert sorted(got) == [f"m/{k}" for k in sorted(SHAPES)]
    assert all(torch.equal(got[f"m/{k}"], want[k]) for k in SHAPES)


def test_a_missing_index_file_is_damage_naming_its_rank(tmp_path: Path) -> None:
    _write(tmp_path)
    (p,) = (tmp_path / step_dir(1) / "data").glob("r00001-*.index.json")
    p.unlink()
    with pytest.raises(CorruptCheckpointError, match="of rank 1 is missing.*restore another step"):
        _restore(tmp_path)


def test_an_index_file_longer_than_recorded_is_refused_unread(tmp_path: Path) -> None:
    _write(tmp_path)
    (p,) = (tmp_path / step_dir(1) / "data").glob("r00001-*.index.json")
    with open(p, "ab") as f:
        f.write(b" " * (1 << 20))
    storage = LocalStorage(tmp_path)
    m = load_manifest(storage, 1)
    reads: list[tuple[int, int]] = []
    orig = storage.read_range
    storage.read_range = lambda path, off, n: reads.append((off, n)) or orig(path, off, n)  # type: ignore[method-assign]
    with pytest.raises(CorruptCheckpointError, match="of rank 1 does not match the size and digest"):
        m.leaves.overlapping("m/c", (16, 0), (16, 32))
    assert reads == []  # its size was compared first: not a byte of it was read


def test_an_incremental_save_over_a_described_leaf_of_other_dimensions(tmp_path: Path) -> None:
    """The base step's m/c is 64 x 32; a 1-d m/c finds nothing to reuse, and saves."""
    _write(tmp_path)
    with CheckpointManager(str(tmp_path), incremental=True, digest_block_bytes=BLOCK) as mgr:
        flat = torch.arange(2048, dtype=torch.float32)
        mgr.save(2, {"m": {"c": flat}}, async_save=False)
        target = {"m": {"c": torch.zeros(2048)}}
        mgr.restore(target, step=2)
    assert torch.equal(target["m"]["c"], flat)


def test_ranks_that_describe_otherwise_are_refused_with_every_cause_and_remedy() -> None:
    """The coordinator compares the digests of what each rank described: a mismatch names the
    ranks, what makes one (DTensors, ShardedTensors, a Fragment's partition) and the remedies."""
    from shardkeeper.core.errors import StateMismatchError

    def report(rank: int, digest: str) -> dict:
        return {
            "rank": rank,
            "declared": {} if rank else {"t": ["tensor", "float32", [4]]},
            "declared_digest": "d",
            "chunks": {"keys": [], "counts": [], "table": ChunkTable([], [], [], [], [], [], [], [], {}, 0)},
            "files": {},
            "objects": {},
            "per_rank_prefixes": [],
            "described": {"digest": digest, "index": None, "chunk_files": []},
        }

    with pytest.raises(StateMismatchError) as e:
        assemble_manifest(
            1, "t", [report(0, "a"), report(1, "b")], world_size=2, digest="xxh3_128", block_bytes=BLOCK, metadata={}
        )
    msg = str(e.value)
    assert "ranks [1] record other leaves by their layout rule than rank 0" in msg, msg
    assert "Fragment whose partition=" in msg and "ShardedTensor" in msg and "describe_layouts=False" in msg, msg


def test_a_flat_partition_restores_and_a_missing_box_is_named(tmp_path: Path) -> None:
    """A 2-rank checkpoint of one leaf under ``["F", pos, part]`` (each rank's part a run of
    boxes in its index file), written as the ranks write it: restored whole in one process;
    with one box's row gone, the damage names that box, the file and the rank."""
    storage = LocalStorage(tmp_path)
    shape, pos, part = (5, 7), 3, 19  # rank 0: elements [0, 16); rank 1: [16, 35)
    full = torch.arange(35, dtype=torch.float32).reshape(shape)
    mesh = Mesh((2,), (0, 1))
    rule = Rule(mesh, (("F", pos, part),), 0)
    declared = {"m/f": ["tensor", "float32", list(shape)]}
    reports = []
    for r in range(2):
        from shardkeeper.core.format.grid import flat_cell_boxes

        rel = f"data/r{r:05d}-0000000{r}-000.safetensors"
        boxes = flat_cell_boxes(shape, rule.placements, r)
        parts = [full[o[0] : o[0] + b[0], o[1] : o[1] + b[1]].contiguous().numpy().tobytes() for o, b in boxes]
        entries = [(chunk_name("m/f", o, b, shape), "float32", b, len(p)) for (o, b), p in zip(boxes, parts)]
        header, at = build_header(entries, {"format": "pt"})
        data = bytearray(header)
        for p, off in zip(parts, at):
            data += bytes(off - len(data)) + p
        storage.put(f"{step_dir(1)}/{rel}", bytes(data))
        digests = [",".join(block_digests(memoryview(p), "xxh3_128", BLOCK)) for p in parts]
        table = ChunkTable(
            [rel], [0] * len(boxes), list(at), [len(p) for p in parts], [2] * len(boxes),
            [v for o, _ in boxes for v in o], [v for _, b in boxes for v in b], digests, {}, 0,
        )  # fmt: skip
        reports.append(_report(storage, r, declared, rel, len(data), ["m/f"] * len(boxes), table))
    m = assemble_manifest(
        1, "t", reports, world_size=2, digest="xxh3_128", block_bytes=BLOCK, metadata={}, described={"m/f": rule}
    )
    storage.put_if_absent(manifest_path(1), m.dumps())
    target = {"m": {"f": torch.zeros(shape)}}
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(target, step=1)
    assert torch.equal(target["m"]["f"], full)
    assert flat_cell_boxes(shape, rule.placements, 1) == [((2, 2), (1, 5)), ((3, 0), (2, 7))]

    def move_second(d):  # rank 1's second row (its whole rows) claims rows 4-5 instead of 3-4
        d["table"]["offsets"][2] = 4

    _edit_index(tmp_path, 1, move_second)
    with pytest.raises(CorruptCheckpointError, match="of rank 1") as e:
        with CheckpointManager(str(tmp_path)) as mgr:
            mgr.restore({"m": {"f": torch.zeros(shape)}}, step=1)
    assert "has no chunk of 'm/f' at [3, 0]+[2, 7], which the layout says rank 1 wrote" in str(e.value), str(e.value)


def test_a_described_save_makes_its_data_directory_durable_once_with_the_index_in_it(tmp_path: Path) -> None:
    """The shard files and the index file share one directory: it is synced once, after both
    are written (in a subprocess: a 1-rank gloo group for the DTensor)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import collections, json, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from shardkeeper.core import CheckpointManager
        from shardkeeper.core.storage import LocalStorage

        class Counting(LocalStorage):
            synced = collections.Counter()
            def sync_dir(self, path):
                self.synced[path] += 1
                super().sync_dir(path)

        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            want = torch.arange(12.0).reshape(6, 2)
            storage = Counting("{tmp_path}/root")
            with CheckpointManager(storage, describe_layouts=True) as mgr:
                mgr.save(1, {{"w": distribute_tensor(want, mesh, [Shard(0)])}}, async_save=False)
                man = json.loads(open("{tmp_path}/root/step-000000000001/manifest.json").read())
                assert man["described"]["keys"] == ["w"], man
                assert Counting.synced["step-000000000001/data"] == 1, dict(Counting.synced)
                got = {{"w": torch.zeros(6, 2)}}
                mgr.restore(got, step=1)
                assert torch.equal(got["w"], want)
        finally:
            dist.destroy_process_group()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


def _with_row(doc: dict, key: str, at: int) -> None:
    """Rank's index with a copy of its first row (one digest block: the rows of ``_write``
    are under 4 KiB) as the row of ``key`` at position ``at``."""
    t = doc["table"]
    nd = t["ndim"][0]
    for name in ("file", "offset", "length", "ndim"):
        t[name].insert(at, t[name][0])
    for name in ("offsets", "shape"):
        t[name][at * nd : at * nd] = t[name][:nd]
    t["digests"] = t["digests"][: at * 32] + t["digests"][:32] + t["digests"][at * 32 :]
    doc["keys"].insert(at, key)


def _extra_row(doc: dict) -> None:
    _with_row(doc, doc["keys"][0], 1)  # m/a twice, as a run (a flat partition's form)


def _other_key(doc: dict) -> None:
    _with_row(doc, "m/nobody", len(doc["keys"]))  # a row of a key no described leaf has


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_extra_row, "lists 2 row(s) of 'm/a', where the layout gives 1 box(es) of rank 1"),
        (_other_key, "lists 1 row(s) of 'm/nobody', where the layout gives 0 box(es) of rank 1"),
    ],
)
def test_verify_says_index_rows_beyond_the_rules_boxes(tmp_path: Path, edit, why: str) -> None:  # type: ignore[no-untyped-def]
    """Rows a restore never asks for (the rule leads it to the boxes it needs) are damage that
    only verify can see: a writer bug, or an edit."""
    _write(tmp_path)
    _edit_index(tmp_path, 1, edit)
    assert _restore(tmp_path).keys() == _full().keys()  # restores do not need them
    problems = [p.message for p in verify_step(LocalStorage(tmp_path), 1).problems]
    assert len(problems) == 1 and why in problems[0] and "r00001-" in problems[0], problems
