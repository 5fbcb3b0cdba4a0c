"""Damaged and hostile checkpoints, part two: every damaged manifest or file fails with a
``CheckpointError`` (damage: a ``CorruptCheckpointError``, so "restore the newest" falls back
to the older step, bit for bit) before any of its data is read. No IndexError, TypeError or
RecursionError escapes from ``Manifest.loads``, ``shardkeeper ls/inspect/verify/gc``,
``steps()`` or ``restore()``; no allocation is larger than the step's files can back; the
tiling check stays near-linear on large legitimate layouts (the examples of docs/format.md:
test_doc_examples.py).

Each root holds step 1 and step 2 (different values); step 2 is damaged by editing its real
manifest (per-chunk form, or the chunk and leaf tables) or its files.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import struct
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardkeeper.core.commit.merge as assemble_mod
from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main as cli_main
from shardkeeper.core.errors import CheckpointError, CorruptCheckpointError, IncompatibleFormatError
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.tiling import check_tiling_boxes
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step
from tests.checks import assert_same_state
from tests.core.format.test_hostile import JSON_VALUES, RecordingStorage, _apply, _paths

STEP2 = "step-000000000002"
BLOCK = 64
#: What a document nested past the limit is told: the parser's own limit (orjson, ~1000) or ours
DEEP = r"nested deeper than 100 levels|not valid JSON \(JSONDecodeError: depth limit exceeded"


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "ints": torch.arange(7, dtype=torch.int64) * seed,
            "cols": torch.randn(2, 6, generator=g),
        },
        "extra": {"blob": f"blob of step {seed}; ".encode() * 4, "cfg": {"lr": 0.1 * seed, "names": ["a", "b"]}},
    }


def target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4, 3), "ints": torch.zeros(7, dtype=torch.int64), "cols": torch.zeros(2, 6)},
        "extra": {"blob": b"", "cfg": {"lr": 0.0, "names": []}},
    }


def assert_same_data(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tensors and bytes equal bit for bit (object values carry no digests: not compared)."""
    assert_same_state(
        {"model": got["model"], "blob": got["extra"]["blob"]}, {"model": want["model"], "blob": want["extra"]["blob"]}
    )


@contextmanager
def table_form(on: bool):  # type: ignore[no-untyped-def]
    old = assemble_mod.TABLE_MIN_CHUNKS
    assemble_mod.TABLE_MIN_CHUNKS = 1 if on else old
    try:
        yield
    finally:
        assemble_mod.TABLE_MIN_CHUNKS = old


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for form in ("chunks", "table"):
        root = tmp_path_factory.mktemp(form) / "root"
        with table_form(form == "table"), CheckpointManager(root, digest_block_bytes=BLOCK) as mgr:
            mgr.save(1, state(1)).wait()
            mgr.save(2, state(2)).wait()
        out[form] = root
    doc = json.loads((out["table"] / STEP2 / "manifest.json").read_bytes())
    assert "chunk_table" in doc and "leaf_table" in doc
    assert "chunk_table" not in json.loads((out["chunks"] / STEP2 / "manifest.json").read_bytes())
    return out


def copy_root(roots: dict[str, Path], form: str, tmp: Path) -> Path:
    root = tmp / form
    shutil.copytree(roots[form], root)
    return root


def deep(n: int) -> str:
    """A placeholder that ``write_step2`` turns into ``n`` nested arrays (json.dumps itself
    cannot write them)."""
    return f"@@deep-{n}@@"


def write_step2(root: Path, doc: dict[str, Any]) -> bytes:
    data = json.dumps(doc).encode()
    data = re.sub(rb'"@@deep-(\d+)@@"', lambda m: b"[" * int(m[1]) + b"0" + b"]" * int(m[1]), data)
    (root / STEP2 / "manifest.json").write_bytes(data)
    return data


def step2(root: Path) -> dict[str, Any]:
    return json.loads((root / STEP2 / "manifest.json").read_bytes())


# -- the table's columns ---------------------------------------------------------------------


def leaf_rows(d: dict[str, Any], key: str) -> list[int]:
    lt = d["leaf_table"]
    j = lt["keys"].index(key)
    a = sum(lt["nrows"][:j])
    return lt["rows"][a : a + lt["nrows"][j]]


def dims(t: dict[str, Any]) -> list[int]:
    return [0, *itertools.accumulate(t["ndim"])]


def digest_span(t: dict[str, Any], r: int) -> tuple[int, int]:
    starts = [0, *itertools.accumulate(-(-n // BLOCK) for n in t["length"])]
    return starts[r] * 32, starts[r + 1] * 32


def scalar_row_before_its_box(d: dict[str, Any], root: Path) -> None:
    """Row r of model/ints becomes 0-d and a copy of it, holding r's box, is inserted after
    it (no leaf lists the copy): the flat offsets/shape columns are unchanged, every other
    column stays consistent. Restored, the 0-d row broadcast one element over the tensor."""
    t, lt = d["chunk_table"], d["leaf_table"]
    (r,) = leaf_rows(d, "model/ints")
    a, b = digest_span(t, r)
    for col in ("file", "offset", "length", "ndim"):
        t[col].insert(r + 1, t[col][r])
    t["digests"] = t["digests"][:b] + t["digests"][a:b] + t["digests"][b:]
    t["ndim"][r] = 0
    lt["rows"] = [x + 1 if x > r else x for x in lt["rows"]]


def scalar_last_row(d: dict[str, Any], root: Path) -> None:
    """The table's last row loses its box (ndim 0): indexing past the columns before."""
    t = d["chunk_table"]
    r = len(t["ndim"]) - 1
    a = dims(t)[r]
    del t["offsets"][a : a + t["ndim"][r]], t["shape"][a : a + t["ndim"][r]]
    t["ndim"][r] = 0


def forged_zstd_blob(d: dict[str, Any], root: Path, claim: int = 1 << 28) -> None:
    """The bytes leaf claims ``claim`` bytes decoded from a 10-byte zstd chunk (its digest
    matches the 10 bytes in the file)."""
    if "chunk_table" in d:
        t = d["chunk_table"]
        (r,) = leaf_rows(d, "extra/blob")
        path = root / STEP2 / t["files"][t["file"][r]]
        data = path.read_bytes()[t["offset"][r] : t["offset"][r] + 10]
        a, b = digest_span(t, r)
        t["digests"] = t["digests"][:a] + xxhash.xxh3_128_hexdigest(data) + t["digests"][b:]
        n = len(t["length"])
        t["extras"] = {"encoding": [None] * n, "content": [None] * n}
        t["extras"]["encoding"][r], t["extras"]["content"][r] = "zstd", "0" * 32
        t["length"][r] = 10
        t["shape"][dims(t)[r]] = claim
        lt = d["leaf_table"]
        j = lt["keys"].index("extra/blob")
        lt["shape"][sum(lt["ndim"][:j])] = claim
        return
    leaf = d["leaves"]["extra/blob"]
    (c,) = leaf["chunks"]
    data = (root / STEP2 / c["file"]).read_bytes()[c["offset"] : c["offset"] + 10]
    leaf["shape"] = [claim]
    c.update(encoding="zstd", content="0" * 32, length=10, shape=[claim], digests=xxh3(data))


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def rename_leaf(old: str, new: str) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], root: Path) -> None:
        if old in d["leaves"]:
            d["leaves"][new] = d["leaves"].pop(old)
        else:
            keys = d["leaf_table"]["keys"]
            keys[keys.index(old)] = new

    return mutate


def top(field: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    return lambda d, root: d.__setitem__(field, value)


def one_file(field: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], root: Path) -> None:
        rec = next(iter(d["files"].values()))
        rec[field] = value

    return mutate


def chunk_field(field: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], root: Path) -> None:
        if "chunk_table" in d:
            d["chunk_table"][field][leaf_rows(d, "model/ints")[0]] = value
        else:
            d["leaves"]["model/ints"]["chunks"][0][field] = value

    return mutate


def extras(columns: dict[str, Any]) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], root: Path) -> None:
        n = len(d["chunk_table"]["offset"])
        d["chunk_table"]["extras"] = {k: [v] * n for k, v in columns.items()}

    return mutate


BOTH = ("chunks", "table")
#: name -> (forms, mutation of step 2's manifest, what the error says)
DAMAGE: dict[str, tuple[Sequence[str], Callable[[dict[str, Any], Path], None], str]] = {
    "scalar-row-broadcast": (("table",), scalar_row_before_its_box, "has 0 dimensions, the leaf has 1"),
    "scalar-last-row": (("table",), scalar_last_row, "has 0 dimensions, the leaf has"),
    "extras-unknown-field": (("table",), extras({"future": None}), "unknown field 'future'"),
    "extras-not-strings": (("table",), extras({"encoding": 5}), "other than strings and null"),
    "created-at-1000-deep": (BOTH, top("created_at", deep(1000)), "nested deeper than 100 levels"),
    "created-at-array": (BOTH, top("created_at", [["2025"]]), "created_at is an array, not a string"),
    "attempt-number": (BOTH, top("attempt", 7), "attempt is an integer, not a string"),
    "metadata-150-deep": (BOTH, top("metadata", {"x": deep(150)}), "nested deeper than 100 levels"),
    "format-version-true": (BOTH, top("format_version", True), "no integer format_version"),
    "step-string": (BOTH, top("step", "2"), "step is a string, not an integer"),
    "world-size-true": (BOTH, top("world_size", True), "world_size is a boolean, not an integer"),
    "block-true": (BOTH, top("digest_block_bytes", True), "digest_block_bytes is a boolean"),
    "size-bytes-true": (BOTH, one_file("size_bytes", True), "no size_bytes that is a non-negative integer"),
    "encryption-not-object": (BOTH, top("encryption", "none"), "encryption is a string, not an object"),
    "chunk-offset-true": (BOTH, chunk_field("offset", True), ""),
    "empty-object-key": (BOTH, rename_leaf("extra/cfg/lr", ""), "empty key"),
    "empty-tensor-key": (("chunks",), rename_leaf("extra/blob", ""), "empty key"),
    "empty-table-key": (("table",), rename_leaf("extra/blob", ""), "empty key"),
    "forged-zstd-64gib": (BOTH, lambda d, r: forged_zstd_blob(d, r, 1 << 36), "more than a zstd frame can hold"),
    "format-version-0": (BOTH, top("format_version", 0), "versions start at 1"),
    "object-without-value": (
        BOTH,
        lambda d, r: d["leaves"]["extra/cfg/lr"].pop("value"),
        "object leaf without a value",
    ),
    "leaf-table-removed": (("table",), lambda d, r: d.pop("leaf_table"), "a chunk_table without a leaf_table"),
    "chunk-table-removed": (("table",), lambda d, r: d.pop("chunk_table"), "a leaf_table without a chunk_table"),
    "shared-row": (
        ("table",),
        lambda d, r: d["leaf_table"]["rows"].__setitem__(1, d["leaf_table"]["rows"][0]),
        "belongs to more than one leaf",
    ),
}
CASES = [(name, form) for name, (forms, _, _) in DAMAGE.items() for form in forms]


def tools_survive(root: Path) -> None:
    """The CLI (with --debug: anything but a CheckpointError propagates), steps() and the
    commit check treat step 2 as damaged and never raise anything else."""
    for argv in (
        ["ls", str(root)],
        ["inspect", str(root), "2"],
        ["verify", str(root)],
        ["gc", str(root), "--dry-run", "--min-age-s", "0"],
    ):
        try:
            cli_main([*argv, "--debug"])
        except CheckpointError:
            pass
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1]
        assert mgr.latest_step() == 1


def falls_back(root: Path) -> None:
    """Restoring the newest step restores step 1 bit for bit, reading none of step 2's data."""
    storage = RecordingStorage(root)
    got = target()
    with pytest.warns(UserWarning, match="damaged"), CheckpointManager(storage) as mgr:
        assert mgr.restore(got) == 1
    assert_same_data(got, state(1))
    assert got["extra"]["cfg"] == {"lr": 0.1, "names": ["a", "b"]}
    assert not [p for p in storage.data_reads if p.startswith(STEP2)], storage.data_reads


@pytest.mark.parametrize(("case", "form"), CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_a_damaged_manifest_is_refused_and_restore_falls_back(
    case: str, form: str, roots: dict[str, Path], tmp_path: Path
) -> None:
    root = copy_root(roots, form, tmp_path)
    _, mutate, expect = DAMAGE[case]
    doc = step2(root)
    mutate(doc, root)
    data = write_step2(root, doc)
    with pytest.raises(CorruptCheckpointError, match=re.escape(expect) if expect else None) as info:
        Manifest.loads(data, where=f"{root}/{STEP2}/manifest.json")
    assert "restore another step" in str(info.value)
    tools_survive(root)
    falls_back(root)


def test_a_scalar_row_restored_one_element_over_the_whole_tensor(roots: dict[str, Path], tmp_path: Path) -> None:
    """The harm the row-dimension check prevents: the 0-d row's record and what it read."""
    root = copy_root(roots, "table", tmp_path)
    doc = step2(root)
    scalar_row_before_its_box(doc, root)
    with pytest.raises(CorruptCheckpointError, match="chunk_table row 0 has 0 dimensions, the leaf has 1"):
        Manifest.loads(write_step2(root, doc), where="x")


def test_a_forged_zstd_bytes_leaf_allocates_nothing(roots: dict[str, Path], tmp_path: Path) -> None:
    """A 10-byte chunk claiming 256 MiB: refused when the manifest is read (before, restore
    allocated the 256 MiB, then failed to decode), in both forms."""
    for form in BOTH:
        root = copy_root(roots, form, tmp_path)
        doc = step2(root)
        forged_zstd_blob(doc, root, 1 << 28)
        write_step2(root, doc)
        tracemalloc.start()
        try:
            falls_back(root)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, peak


def test_the_zstd_bound_is_the_format_s(tmp_path: Path) -> None:
    """RFC 8878 by hand: a frame of k RLE blocks of 128 KiB (a 9-byte header: magic, a
    single-segment descriptor, a 4-byte content size; then 4 bytes a block) decodes to
    k * 128 KiB, within 32768 * (L - 6); one byte more than the bound is refused, and real
    compressor output of zeros stays within it."""
    zstandard = pytest.importorskip("zstandard")
    from shardkeeper.core.format.bounds import ZSTD_MAX_EXPANSION, max_decoded_bytes
    from shardkeeper.core.format.records import encoded_length_problem

    k = 64
    header = struct.pack("<I", 0xFD2FB528) + bytes([0b1010_0000]) + struct.pack("<I", k << 17)
    blocks = b"".join(struct.pack("<I", (i == k - 1) | 1 << 1 | (1 << 17) << 3)[:3] + b"\x07" for i in range(k))
    frame = header + blocks
    decoded = zstandard.ZstdDecompressor().decompress(frame)
    assert decoded == b"\x07" * (k << 17)
    assert 0.98 * max_decoded_bytes(len(frame)) < len(decoded) <= max_decoded_bytes(len(frame))  # tight
    assert len(decoded) / len(frame) > 0.96 * ZSTD_MAX_EXPANSION
    assert encoded_length_problem("zstd", len(frame), len(decoded)) is None
    limit = max_decoded_bytes(len(frame))
    assert encoded_length_problem("zstd", len(frame), limit) is None
    assert "more than a zstd frame can hold" in str(encoded_length_problem("shuffle-zstd", len(frame), limit + 1))
    for level in (1, 19):
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(bytes(64 << 20))
        assert encoded_length_problem("zstd", len(frame), 64 << 20) is None


def shared_bytes_blob(d: dict[str, Any], root: Path, copies: int = 200) -> None:
    """The bytes leaf becomes ``copies`` raw chunks that all name its one stored range."""
    leaf = d["leaves"]["extra/blob"]
    (c,) = leaf["chunks"]
    n = c["length"]
    leaf["shape"] = [n * copies]
    leaf["chunks"] = [dict(c, offsets=[i * n]) for i in range(copies)]


def test_chunks_that_share_stored_bytes_are_refused_before_allocating(roots: dict[str, Path], tmp_path: Path) -> None:
    """Every chunk lies inside its file and its digests match, but together they claim more
    bytes than the files hold: restore (a bytes leaf) and export (a tensor) refuse before
    allocating (before, restore returned the forged blob and export the forged tensor)."""
    from shardkeeper.core.tools.export import export_safetensors

    root = copy_root(roots, "chunks", tmp_path)
    doc = step2(root)
    shared_bytes_blob(doc, root)
    write_step2(root, doc)
    Manifest.loads((root / STEP2 / "manifest.json").read_bytes(), where="x")  # consistent by itself
    falls_back(root)

    doc = step2(root)  # a tensor of 64 rows, each the stored bytes of model/w's first row
    w = doc["leaves"]["model/w"]
    c = w["chunks"][0]
    row = (root / STEP2 / c["file"]).read_bytes()[c["offset"] : c["offset"] + 12]
    w["shape"] = [64, 3]
    w["chunks"] = [dict(c, offsets=[i, 0], shape=[1, 3], length=12, digests=xxh3(row)) for i in range(64)]
    write_step2(root, doc)
    with pytest.raises(CorruptCheckpointError, match="more than the .* their 1 file"):
        export_safetensors(root, 2, to=tmp_path / "out", keys=["model/w"])


def test_a_deep_safetensors_header_is_a_verify_problem(tmp_path: Path) -> None:
    """A shard file whose header is 1,500 arrays deep: `verify` reports it (before: a
    RecursionError out of `shardkeeper verify`)."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {f"t{i:02d}": torch.full((2,), float(i)) for i in range(60)}).wait()
    (f,) = (root / "step-000000000001" / "data").iterdir()
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    depth = (n - 7) // 2
    assert depth >= 1500
    raw[8 : 8 + n] = (b'{"a":' + b"[" * depth + b"]" * depth + b"}").ljust(n)
    f.write_bytes(bytes(raw))
    report = verify_step(LocalStorage(root), 1)
    assert [p.kind for p in report.problems] == ["header"], report.problems
    assert re.search(DEEP, report.problems[0].message), report.problems[0].message
    assert cli_main(["verify", str(root), "--debug"]) == 1


def test_a_deep_encryption_header_falls_back(tmp_path: Path) -> None:
    """Step 2's data files get an encryption header 3,000 arrays deep (the ciphertext
    unchanged): restore falls back to step 1 bit for bit, verify without the key reports it
    (before: a RecursionError out of both)."""
    pytest.importorskip("cryptography")
    from shardkeeper.core import LocalKeyProvider

    keys = LocalKeyProvider(bytes(range(32)), "the test key")
    root = tmp_path / "root"
    with CheckpointManager(root, encryption=keys, digest_block_bytes=BLOCK) as mgr:
        mgr.save(1, state(1)).wait()
        mgr.save(2, state(2)).wait()
    for f in (root / STEP2 / "data").iterdir():
        raw = f.read_bytes()
        (n,) = struct.unpack("<I", raw[8:12])
        header = b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}"
        f.write_bytes(raw[:8] + struct.pack("<I", len(header)) + header + raw[12 + n :])
    got = target()
    with pytest.warns(UserWarning, match="damaged"), CheckpointManager(root, encryption=keys) as mgr:
        assert mgr.restore(got) == 1
    assert_same_data(got, state(1))
    report = verify_step(LocalStorage(root), 2)
    assert report.problems and {p.kind for p in report.problems} == {"header"}, report.problems
    assert re.search(DEEP, report.problems[0].message), report.problems[0].message


def test_a_deep_encryption_member_is_damage(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from shardkeeper.core import LocalKeyProvider

    keys = LocalKeyProvider(bytes(range(32)), "the test key")
    root = tmp_path / "root"
    with CheckpointManager(root, encryption=keys) as mgr:
        mgr.save(1, state(1)).wait()
        mgr.save(2, state(2)).wait()
    path = root / STEP2 / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data.replace(b',"encryption":{', b',"encryption":{"x":' + b"[" * 2000 + b"]" * 2000 + b",", 1))
    got = target()
    with (
        pytest.warns(UserWarning, match=f"its encryption member is ({DEEP})"),
        CheckpointManager(root, encryption=keys) as mgr,
    ):
        assert mgr.restore(got) == 1
    assert_same_data(got, state(1))


def test_loads_untrusted_bounds_both_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkeeper.core.errors import UntrustedJSONError
    from shardkeeper.core.format import untrusted

    for parser in (untrusted._orjson, None):
        monkeypatch.setattr(untrusted, "_orjson", parser)
        for depth, why in ((100, None), (101, "nested deeper than 100"), (100_000, "not valid JSON")):
            doc = b"[" * depth + b"]" * depth
            if why is None:
                untrusted.loads_untrusted(doc, max_bytes=1 << 20)
            else:
                with pytest.raises(UntrustedJSONError, match=why):
                    untrusted.loads_untrusted(doc, max_bytes=1 << 20)
        with pytest.raises(UntrustedJSONError, match="more than the 10"):
            untrusted.loads_untrusted(b"[1,2,3,4,5]", max_bytes=10)
    assert not untrusted.too_deep({"a": list(range(1000)), "b": [[1.5, True, None, "x"]]}, 3)
    assert not untrusted.too_deep([1e308, 10**400], 1) and untrusted.too_deep([1e308, 10**400, [[]]], 2)
    assert untrusted.too_deep({"a": [{"b": [[]]}]}, 3)


# -- tiling ----------------------------------------------------------------------------------


def reference_tiling(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """The pairwise check ``check_tiling_boxes`` had before the signed-corner test (quadratic:
    the reference it must agree with)."""
    total, ndim = math.prod(shape), len(shape)
    vol = 0
    for offs, bshape in boxes:
        if len(offs) != ndim or len(bshape) != ndim:
            return False
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(offs, bshape, shape)):
            return False
        vol += math.prod(bshape)
    if vol != total:
        return False
    if len(boxes) > 1 and total > 0:
        nonempty = sorted((tuple(o), tuple(n)) for o, n in boxes if math.prod(n) > 0)
        if ndim == 0:
            return len(nonempty) == 1
        for i, (ao, an) in enumerate(nonempty):
            for bo, bn in nonempty[i + 1 :]:
                if bo[0] >= ao[0] + an[0]:
                    break
                if all(b < a + asz and a < b + bsz for a, asz, b, bsz in zip(ao, an, bo, bn)):
                    return False
    return True


def coverage(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Counter[tuple[int, ...]]:
    """How many boxes hold each element of the tensor (brute force)."""
    out: Counter[tuple[int, ...]] = Counter()
    for offs, bshape in boxes:
        out.update(itertools.product(*[range(o, o + n) for o, n in zip(offs, bshape)]))
    return out


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """A tensor and boxes: a random guillotine tiling, then maybe one box moved, grown,
    shrunk, duplicated, dropped or added."""
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    boxes = [([0] * len(shape), list(shape))]
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(boxes) - 1))
        offs, bshape = boxes[i]
        dims_ = [d for d in range(len(shape)) if bshape[d] > 1]
        if not dims_:
            continue
        d = draw(st.sampled_from(dims_))
        cut = draw(st.integers(1, bshape[d] - 1))
        a, b = (list(offs), list(bshape)), (list(offs), list(bshape))
        a[1][d] = cut
        b[0][d] += cut
        b[1][d] -= cut
        boxes[i : i + 1] = [a, b]
    op = draw(st.sampled_from(["none", "none", "move", "grow", "shrink", "duplicate", "drop", "add", "empty"]))
    if op != "none" and shape:
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(shape) - 1))
        offs, bshape = list(boxes[i][0]), list(boxes[i][1])
        if op == "move":
            offs[d] += draw(st.sampled_from([-1, 1]))
        elif op == "grow":
            bshape[d] += 1
        elif op == "shrink":
            bshape[d] -= 1
        boxes[i] = (offs, bshape)
        if op == "duplicate":
            boxes.append(boxes[i])
        elif op == "drop" and len(boxes) > 1:
            del boxes[i]
        elif op in ("add", "empty"):
            extent = [draw(st.integers(0, max(0, g - 1))) for g in shape]
            size = [0 if op == "empty" and k == d else draw(st.integers(0, 2)) for k in range(len(shape))]
            boxes.append((extent, size))
    return shape, boxes


@settings(max_examples=1500, deadline=None)
@given(layout=layouts())
def test_the_corner_test_agrees_with_the_pairwise_check_and_with_brute_force(
    layout: tuple[list[int], list[tuple[list[int], list[int]]]],
) -> None:
    shape, boxes = layout
    why = check_tiling_boxes("k", shape, boxes)
    exact = reference_tiling(shape, boxes)
    assert (why is None) == exact, (why, shape, boxes)
    in_bounds = all(o >= 0 and n >= 0 and o + n <= g for offs, bs in boxes for o, n, g in zip(offs, bs, shape))
    if in_bounds and all(len(o) == len(shape) for o, _ in boxes):
        cover = coverage(shape, boxes)
        once = all(cover[x] == 1 for x in itertools.product(*map(range, shape)))
        truth = once and sum(cover.values()) == math.prod(shape)
        assert (why is None) == truth, (why, shape, boxes)
    m = re.search(r"chunks (\[.*?\]) and (\[.*?\]) of k overlap \(both hold element (\[.*?\])\)", why or "")
    if m:  # the named chunks really hold the named element
        a, b, at = (json.loads(g) for g in m.groups())
        held = [o for o, n in boxes if all(x >= p and x < p + s for p, s, x in zip(o, n, at)) and list(o) in (a, b)]
        assert len(held) >= 2 and coverage(shape, boxes)[tuple(at)] >= 2
    m = re.search(r"no chunk of k holds element (\[.*?\])", why or "")
    if m:
        assert coverage(shape, boxes)[tuple(json.loads(m[1]))] == 0


@pytest.mark.timeout(120)
def test_200000_column_chunks_are_checked_in_seconds_not_hours() -> None:
    """A [8, 200000] tensor split along dimension 1 (before: hours; 2,000 chunks took ~2 s)."""
    n = 200_000
    boxes = [([0, i], [8, 1]) for i in range(n)]
    t = time.process_time()
    assert check_tiling_boxes("k", [8, n], boxes) is None
    boxes[n // 2] = ([0, n // 2 + 1], [8, 1])
    assert "overlap" in str(check_tiling_boxes("k", [8, n], boxes))
    assert time.process_time() - t < 20  # measured: ~0.6 s a check


def test_a_layout_split_along_13_dimensions_is_refused_not_checked_for_minutes() -> None:
    shape = [2] * 13
    boxes = [(list(c), [1] * 13) for c in itertools.product(range(2), repeat=13)]
    t = time.process_time()
    why = check_tiling_boxes("k", shape, boxes)
    assert why is not None and "split the tensor along 13 dimensions" in why and "no writer" in why
    assert time.process_time() - t < 5


# -- fuzzing ---------------------------------------------------------------------------------


def _int_paths(doc: Any) -> list[tuple[Any, ...]]:
    out = []
    for p in _paths(doc):
        v = doc
        for k in p:
            v = v[k]
        if type(v) is int:
            out.append(p)
    return out


def _targeted(d: dict[str, Any], root: Path, data: st.DataObject) -> None:
    """One mutation aimed at the checks above (or a generic one from test_hostile)."""
    table = "chunk_table" in d
    kind = data.draw(st.sampled_from(["ndim", "extras", "deep", "bool", "encoded", "empty-key", "generic"]))
    event(f"{'table' if table else 'chunks'}: {kind}")
    if kind == "ndim" and table:
        t = d["chunk_table"]
        r = data.draw(st.integers(0, len(t["ndim"]) - 1))
        t["ndim"][r] = data.draw(st.integers(0, 3))
    elif kind == "ndim":
        leaf = d["leaves"][data.draw(st.sampled_from(["model/w", "model/ints", "extra/blob"]))]
        c = leaf["chunks"][0]
        boxes = [([], []), ([0, 0], [*c["shape"], 1]), ([0], c["shape"][:1])]
        c["offsets"], c["shape"] = data.draw(st.sampled_from(boxes))
    elif kind == "extras" and table:
        n = len(d["chunk_table"]["offset"])
        name = data.draw(st.sampled_from(["encoding", "content", "future", ""]))
        value = data.draw(st.sampled_from([None, "zstd", "raw", "x", 3, True]))
        d["chunk_table"].setdefault("extras", {})[name] = [value] * n
    elif kind == "deep":
        path = data.draw(st.sampled_from(_paths(d)))
        _apply(d, path, "replace", deep(data.draw(st.sampled_from([1, 50, 97, 98, 99, 100, 150, 1100, 5000]))))
    elif kind == "bool":
        ints = _int_paths(d)
        if ints:
            _apply(d, data.draw(st.sampled_from(ints)), "replace", data.draw(st.booleans()))
    elif kind == "encoded":
        forged_zstd_blob(d, root, data.draw(st.sampled_from([1 << 10, 32768 * 4, 32768 * 4 + 1, 1 << 30])))
        if not table:
            encoding = data.draw(st.sampled_from(["zstd", "shuffle-zstd", "lz4"]))
            d["leaves"]["extra/blob"]["chunks"][0]["encoding"] = encoding
    elif kind == "empty-key":
        key = data.draw(st.sampled_from(["extra/cfg/lr", "extra/blob", "model/w"]))
        rename_leaf(key, "")(d, root)
    else:
        path = data.draw(st.sampled_from(_paths(d)))
        op = data.draw(st.sampled_from(["replace", "delete", "negate", "huge", "duplicate", "wrap"]))
        _apply(d, path, op, data.draw(JSON_VALUES) if op == "replace" else None)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_fuzz_only_checkpoint_errors_escape_and_restore_falls_back_bit_for_bit(
    roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    form = data.draw(st.sampled_from(BOTH))
    root = copy_root(roots, form, tmp_path_factory.mktemp("fuzz"))
    doc = step2(root)
    for _ in range(data.draw(st.integers(1, 2))):
        try:
            _targeted(doc, root, data)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OSError):
            pass  # an earlier mutation removed or retyped what this one edits (or reads: a file)
    raw = write_step2(root, doc)
    newer = False  # a format_version above this reader's: committed but unreadable (format.md 2)
    try:
        Manifest.loads(raw, where="fuzz")
        valid = True
    except IncompatibleFormatError:
        valid = newer = True
    except CheckpointError:
        valid = False
    event("manifest newer" if newer else "manifest valid" if valid else "manifest refused")
    for argv in (["ls", str(root)], ["inspect", str(root), "2"], ["verify", str(root)]):
        try:
            cli_main([*argv, "--debug"])
        except CheckpointError:
            pass
    with CheckpointManager(root) as mgr:
        assert mgr.steps() in ([1], [1, 2])
    got = target()
    try:
        with CheckpointManager(root) as mgr, _quiet():
            step = mgr.restore(got)
    except CheckpointError as e:
        # a consistent manifest of another state (a dtype or kind edited), or a newer format
        assert valid and (isinstance(e, IncompatibleFormatError) == newer), e
        event(f"restore refused: {type(e).__name__}")
        return
    assert not newer
    event(f"restored step {step}")
    assert_same_data(got, state(step))
    if not valid:
        assert step == 1


@contextmanager
def _quiet():  # type: ignore[no-untyped-def]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_an_encryption_member_added_to_a_plain_step_is_damage(roots: dict[str, Path], tmp_path: Path) -> None:
    """Without a key, a manifest that claims encryption over plain data files was edited: restore
    falls back instead of asking for a key that nothing was encrypted with."""
    root = copy_root(roots, "chunks", tmp_path)
    doc = step2(root)
    doc["encryption"] = {"algorithm": "AES-256-GCM", "key_id": "sha256:0", "wrapped_mac_key": "", "mac": "0" * 64}
    write_step2(root, doc)
    got = target()
    with pytest.warns(UserWarning, match="damaged"), CheckpointManager(root) as mgr:
        assert mgr.restore(got) == 1  # (its first data file's first 8 bytes were read: no magic)
    assert_same_data(got, state(1))
