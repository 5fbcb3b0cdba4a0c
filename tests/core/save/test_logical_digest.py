"""Logical digests (docs/format.md, "Logical digests"): the definition, its layout
invariance (any tiling's partials combine to the whole tensor's digest), what it detects,
the manifest's ``logical`` member, and a real save recording it (one process here; three
gloo ranks in ``test_the_manifest_digests_equal_the_full_tensors_at_3_ranks``)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkeeper.core import (
    CheckpointManager,
    CorruptCheckpointError,
    logical_combine,
    logical_digest,
    logical_partial,
)
from shardkeeper.core.cli import main as cli_main
from shardkeeper.core.commit.protocol import RankReport
from shardkeeper.core.format import logical
from shardkeeper.core.format.logical_member import (
    combine_reports,
    decode_sums,
    digests_of,
    encode_sums,
    member_problem,
)
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.save.logical import split_sums, with_group_sums
from tests.checks import assert_checks, read_checks
from tests.core._launch import run_workers

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def small_chunks() -> Iterator[None]:
    """The implementation's bounds made tiny, so small tensors take every path: long runs cut
    in parts, runs batched into shared buffers, short runs row by row."""
    old = logical._CHUNK, logical._LONG
    logical._CHUNK, logical._LONG = 96, 8
    try:
        yield
    finally:
        logical._CHUNK, logical._LONG = old


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all: the digest is of the bits)."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def box(t: torch.Tensor, offsets: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, size))]


def partials(t: torch.Tensor, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[Any]:
    return [logical_partial(box(t, o, s), o, t.shape) for o, s in boxes]


# -- strategies: tensors and their tilings ------------------------------------------------------

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple) | st.lists(
    st.integers(1, 70), min_size=1, max_size=2
).map(tuple)


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    return tensor_of(draw(st.sampled_from(DTYPES)), draw(shapes), draw(st.integers(0, 2**31)))


@st.composite
def grid_tiling(draw: Any, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut points per dimension (uneven, empty parts included), every product of parts: the
    boxes of Shard(d) and 2-D meshes."""
    per_dim = []
    for n in shape:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        edges = [0, *cuts, n]
        per_dim.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for parts in per_dim:
        out = [(o + (a,), s + (n,)) for o, s in out for a, n in parts]
    return out


@st.composite
def guillotine_tiling(
    draw: Any, shape: tuple[int, ...], depth: int = 4
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A box split along a random dimension at a random point, each side again: rectangular
    tilings that no per-dimension grid gives."""

    def split(offsets: tuple[int, ...], size: tuple[int, ...], left: int) -> list[Any]:
        dims = [d for d, n in enumerate(size) if n > 1]
        if not left or not dims or not draw(st.booleans()):
            return [(offsets, size)]
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, size[d] - 1))
        lo = (offsets, size[:d] + (cut,) + size[d + 1 :])
        hi = (offsets[:d] + (offsets[d] + cut,) + offsets[d + 1 :], size[:d] + (size[d] - cut,) + size[d + 1 :])
        return split(*lo, left - 1) + split(*hi, left - 1)

    return split((0,) * len(shape), shape, depth)


# -- the definition ---------------------------------------------------------------------------


def test_the_definitions_constants() -> None:
    assert logical.sm64(0) == 0xE220A8397B1DCDAF  # splitmix64 seeded 0: its first output
    a = [logical.lane_weight(j) for j in range(logical.BLOCK)]
    assert len(set(a)) == 64 and all(w % 2 == 1 and w < 2**31 for w in a)
    assert a[:2] == [0x552875, 0x49BD7E1F]
    assert logical.block_multiplier(0) == 0x481EC0A212A9F3DB and logical.block_multiplier(7) % 2 == 1


def test_the_test_vectors_of_the_format() -> None:
    """The values docs/format.md gives, from the implementation and from the definition."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert logical.reference_sum(t.numpy().tobytes(), 4, (2, 3), (0, 0), (2, 3)) == 0xA631A3E3D6E443E0
    assert logical_partial(t[0:1], (0, 0), (2, 3)).value == 0x57BAA427A3ECAE80
    assert logical_partial(t[1:2], (1, 0), (2, 3)).value == 0x4E76FFBC32F79560
    assert logical_digest(t) == "56a2829e023e9fdb"
    assert logical_digest(torch.tensor(1.0, dtype=torch.bfloat16)) == "bf532d0f8a05bec1"
    assert logical_digest(torch.empty(0, dtype=torch.uint8)) == "de58ac3a23dd5bb9"
    assert logical_digest(torch.tensor([True, False, True])) == "feab3f85bc02b8a9"


@FUZZ
@given(t=tensors(), data=st.data())
def test_box_sums_are_the_definition_lane_by_lane(t: torch.Tensor, data: Any) -> None:
    shape = tuple(t.shape)
    offsets = tuple(data.draw(st.integers(0, n)) for n in shape)
    size = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    piece = box(t, offsets, size).contiguous()
    raw = piece.reshape(-1).view(torch.uint8).numpy().tobytes() if piece.numel() else b""
    want = logical.reference_sum(raw, t.element_size(), shape, offsets, size)
    assert logical_partial(piece, offsets, shape).value == want
    with small_chunks():
        assert logical_partial(piece, offsets, shape).value == want


def test_dtype_and_shape_are_bound() -> None:
    t = torch.arange(12, dtype=torch.int32)
    digests = {
        logical_digest(t),
        logical_digest(t.reshape(3, 4)),
        logical_digest(t.reshape(4, 3)),
        logical_digest(t.view(torch.float32)),
        logical_digest(t.view(torch.uint8)),
    }
    assert len(digests) == 5


def test_layout_in_memory_does_not_matter() -> None:
    t = tensor_of(torch.float32, (6, 9), 3)
    assert logical_digest(t.t().contiguous().t()) == logical_digest(t)  # column-major storage
    assert logical_partial(t.t()[2:5].t(), (0, 2), (6, 9)) == logical_partial(t[:, 2:5].contiguous(), (0, 2), (6, 9))


# -- layout invariance ------------------------------------------------------------------------


@FUZZ
@given(t=tensors(), data=st.data())
def test_any_grid_tiling_combines_to_the_digest(t: torch.Tensor, data: Any) -> None:
    """Shard(0), Shard(1), uneven and empty shards, 2-D (and N-D) meshes."""
    boxes = data.draw(grid_tiling(tuple(t.shape)))
    parts = partials(t, boxes)
    want = logical_digest(t)
    assert logical_combine(parts) == want
    assert logical_combine(reversed(parts)) == want  # any order
    with small_chunks():
        assert logical_combine(partials(t, boxes)) == want


@FUZZ
@given(t=tensors(), data=st.data())
def test_any_rectangular_tiling_combines_to_the_digest(t: torch.Tensor, data: Any) -> None:
    boxes = data.draw(guillotine_tiling(tuple(t.shape)))
    assert logical_combine(partials(t, boxes)) == logical_digest(t)
    with small_chunks():
        assert logical_combine(partials(t, boxes)) == logical_digest(t)


@FUZZ
@given(t=tensors(), data=st.data())
def test_flat_ranges_combine_to_the_digest(t: torch.Tensor, data: Any) -> None:
    """ZeRO's partitions: ranges of the row-major order, whatever rows they cut."""
    flat = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    n, size = t.numel(), t.element_size()
    edges = [0, *sorted(data.draw(st.lists(st.integers(0, n), max_size=4))), n]
    runs = [(flat[a * size : b * size], size, a) for a, b in zip(edges, edges[1:])]
    total = logical.combine_sums(logical.run_sums(runs))
    assert logical.finalize(str(t.dtype).removeprefix("torch."), tuple(t.shape), total) == logical_digest(t)


@FUZZ
@given(data=st.data(), wide=st.booleans())
def test_short_runs_gathered_from_one_buffer_are_the_definition(data: Any, wide: bool) -> None:
    """A staged file's many small tensors, summed from their shared buffer at once."""
    size = 2 if wide else 1
    runs = data.draw(st.lists(st.tuples(st.integers(1, 150), st.integers(0, 300)), min_size=1, max_size=12))
    buf, starts = bytearray(), []
    for n, _ in runs:
        buf += bytes(data.draw(st.integers(0, 3)) * size)  # gaps, as alignment leaves
        starts.append(len(buf))
        buf += bytes(data.draw(st.lists(st.integers(0, 255), min_size=n * size, max_size=n * size)))
    counts, firsts = [n for n, _ in runs], [p for _, p in runs]
    want = [
        logical.reference_sum(bytes(buf[a : a + n * size]), size, (p + n,), (p,), (n,))
        for a, (n, p) in zip(starts, runs)
    ]
    assert logical.gathered_sums(memoryview(buf), starts, counts, firsts, wide) == want
    with small_chunks():
        assert logical.gathered_sums(memoryview(buf), starts, counts, firsts, wide) == want


def test_dtensor_partials_combine_to_the_digest() -> None:
    """A DTensor, a ShardedTensor or a fragment gives its own pieces (one process: its mesh
    of one rank holds the whole tensor)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardkeeper.core import Fragment

    t = tensor_of(torch.bfloat16, (5, 7), 9)
    with _one_rank_group():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            assert logical_combine([logical_partial(distribute_tensor(t, mesh, placements))]) == logical_digest(t)
    flat = t.reshape(-1)
    frags = [Fragment(flat[a:b].clone(), (5, 7), a) for a, b in ((0, 3), (3, 30), (30, 35))]  # ZeRO's
    assert logical_combine([logical_partial(f) for f in frags]) == logical_digest(t)


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- what it detects --------------------------------------------------------------------------


@st.composite
def rows_case(draw: Any) -> tuple[torch.Tensor, int, int, int]:
    """A tensor of at least two dimensions or rows and two disjoint row ranges of one length."""
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(2, 40))
    shape = (rows, *draw(st.lists(st.integers(1, 9), max_size=2)))
    t = tensor_of(dtype, shape, draw(st.integers(0, 2**31)))
    n = draw(st.integers(1, rows // 2))
    a = draw(st.integers(0, rows - 2 * n))
    b = draw(st.integers(a + n, rows - n))
    return t, a, b, n


@FUZZ
@given(case=rows_case())
def test_swapped_duplicated_and_zeroed_pieces_change_the_digest(case: tuple[torch.Tensor, int, int, int]) -> None:
    t, a, b, n = case
    want = logical_digest(t)
    swapped = t.clone()
    swapped[a : a + n], swapped[b : b + n] = t[b : b + n], t[a : a + n]
    duplicated = t.clone()
    duplicated[b : b + n] = t[a : a + n]  # one piece's bytes written for another's
    zeroed = t.clone()
    zeroed[a : a + n] = 0
    for name, bad in (("swapped", swapped), ("duplicated", duplicated), ("zeroed", zeroed)):
        if not torch.equal(bad.view(torch.uint8), t.view(torch.uint8)):
            assert logical_digest(bad) != want, name


@FUZZ
@given(case=rows_case(), delta=st.integers(-3, 3).filter(bool))
def test_a_piece_reported_at_a_wrong_offset_changes_the_combination(
    case: tuple[torch.Tensor, int, int, int], delta: int
) -> None:
    """A writer that puts a rank's piece at a shifted place: its partial, combined with the
    others, is not the tensor's digest (unless the piece is all zero bits)."""
    t, a, _, n = case
    rows = t.shape[0]
    start = min(max(a + delta, 0), rows - n)
    if start == a:
        return
    rest = t.shape[1:]
    pieces = [((0,) + (0,) * len(rest), (a,) + rest), ((a + n,) + (0,) * len(rest), (rows - a - n,) + rest)]
    good = partials(t, pieces)
    moved = logical_partial(t[a : a + n], (start,) + (0,) * len(rest), t.shape)
    assert logical_combine([*good, logical_partial(t[a : a + n], (a,) + (0,) * len(rest), t.shape)]) == logical_digest(
        t
    )
    if t[a : a + n].view(torch.uint8).any():
        assert logical_combine([*good, moved]) != logical_digest(t)


@FUZZ
@given(t=tensors().filter(lambda t: t.numel() > 0), data=st.data())
def test_one_changed_element_always_changes_the_digest(t: torch.Tensor, data: Any) -> None:
    flat = t.reshape(-1).view(torch.uint8).clone()
    size = t.element_size()
    i = data.draw(st.integers(0, t.numel() - 1))
    byte = i * size + data.draw(st.integers(0, size - 1))
    flat[byte] ^= 1 if t.dtype == torch.bool else data.draw(st.integers(1, 255))
    assert logical_digest(flat.view(t.dtype).reshape(t.shape)) != logical_digest(t)


# -- the API's refusals -----------------------------------------------------------------------


def test_the_api_refuses_what_it_cannot_digest() -> None:
    with pytest.raises(TypeError, match="offsets"):
        logical_partial(torch.ones(2))
    with pytest.raises(ValueError, match="not inside"):
        logical_partial(torch.ones(2), (3,), (4,))
    with pytest.raises(ValueError, match="at least one"):
        logical_combine([])
    with pytest.raises(ValueError, match="different tensors"):
        logical_combine([logical_partial(torch.ones(2), (0,), (4,)), logical_partial(torch.ones(2).int(), (2,), (4,))])
    with pytest.raises(TypeError, match="dtype complex64"):
        logical_digest(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="whole torch.Tensor"):
        logical_digest([1, 2])  # type: ignore[arg-type]


# -- the manifest member and the reports ------------------------------------------------------


def test_sums_on_the_wire() -> None:
    assert encode_sums([0, 255, 2**64 - 1]) == ",ff,ffffffffffffffff"
    assert decode_sums(",ff,ffffffffffffffff", 3) == [0, 255, 2**64 - 1]
    assert decode_sums("", 0) == [] and decode_sums("", 1) == [0]
    for bad, n in (("ff", 2), ("x", 1), ("1,2", 1), ("1" * 17, 1), (5, 1), ("a", 0)):
        with pytest.raises(ValueError):
            decode_sums(bad, n)


def _report(rank: int, keys: list[str], sums: list[int], **more: Any) -> dict[str, Any]:
    return {"rank": rank, "chunks": {"keys": keys, "counts": [1] * len(keys), "logical": encode_sums(sums)}, **more}


def test_the_coordinator_adds_every_ranks_sums() -> None:
    declared = {"a": ["tensor", "float32", [4]], "b": ["tensor", "int8", [2, 2]], "d": ["tensor", "bfloat16", [6]]}
    reports = [
        _report(0, ["a"], [5], described={"logical": "1"}),
        _report(1, ["a", "b"], [2**64 - 2, 9], described={"logical": "2"}),
    ]
    member = combine_reports(reports, declared, ["d"])
    assert member is not None and member["algorithm"] == "sk-logical-1"
    assert member["digests"].split(",") == [
        logical.finalize("float32", [4], 3),
        logical.finalize("int8", [2, 2], 9),
        logical.finalize("bfloat16", [6], 3),
    ]
    dropped = combine_reports(reports, declared, ["d"], {"b": None})  # (no reports cover "b" once)
    assert dropped is not None and dropped["digests"].split(",")[1] == ""
    # a leaf whose copies two ranks wrote: only the covering reports' sums count (rank 0's
    # report, index 0, alone for "a"; its sum 5, not 5 + 2**64 - 2)
    covered = combine_reports(reports, declared, ["d"], {"a": [0]})
    assert covered is not None and covered["digests"].split(",")[0] == logical.finalize("float32", [4], 5)
    assert combine_reports([*reports, {"rank": 2, "chunks": {"keys": []}}], declared, ["d"]) is None  # an old writer
    with pytest.raises(ValueError, match="rank 1's report"):
        combine_reports([reports[0], _report(1, ["a", "b"], [1])], declared, [])


def test_a_group_leader_adds_its_ranks_described_sums() -> None:
    base = dict(attempt="x", declared={}, declared_digest="", files={}, objects={}, bases=[], extended=False)
    base.update(per_rank_prefixes=[], layouts=[])
    reps = [
        RankReport(rank=r, chunks={"keys": [], "logical": ""}, described={"digest": "d", "logical": text}, **base)
        for r, text in ((1, "1,,ff"), (2, "2,3,1"))
    ]
    other = replace(reps[1], described={"digest": "d"})  # a kind the leader carries, its sums taken
    folded = with_group_sums(replace(reps[0], group={"count": 2, "others": [other]}), reps)
    assert folded.described["logical"] == "3,3,100"
    assert folded.group["others"][0].described["logical"] == ",,"  # counted once: in the leader's
    old = RankReport(rank=3, chunks={"keys": []}, described={"digest": "d"}, **base)
    assert "logical" not in with_group_sums(old, [old, reps[1]]).described
    kept, described = split_sums({"keys": ["a", "d"], "logical": "1,2"}, {"keys": ["a"]}, {"d": 0, "c": 0})
    assert kept["logical"] == "1" and described == {"logical": ",2"}  # c, d sorted


def _manifest(tmp_path: Path) -> tuple[Path, bytes]:
    state = {"w": tensor_of(torch.float32, (8, 5), 1), "b": b"bytes", "n": 3}
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, state, async_save=False)
    path = tmp_path / "root" / "step-000000000001" / "manifest.json"
    return path, path.read_bytes()


def test_the_member_is_checked_and_optional(tmp_path: Path) -> None:
    path, data = _manifest(tmp_path)
    doc = json.loads(data)
    assert doc["logical"]["algorithm"] == "sk-logical-1" and len(doc["logical"]["digests"].split(",")) == 2
    m = Manifest.loads(data)
    assert digests_of(m.logical, m.leaves) == {
        "b": logical_digest(torch.frombuffer(bytearray(b"bytes"), dtype=torch.uint8)),
        "w": logical_digest(tensor_of(torch.float32, (8, 5), 1)),
    }
    without = {k: v for k, v in doc.items() if k != "logical"}
    assert Manifest.loads(json.dumps(without).encode()).logical is None  # older writers: none
    other = {**doc, "logical": {"algorithm": "sk-logical-9", "digests": "whatever"}}
    m2 = Manifest.loads(json.dumps(other).encode())  # another definition's: ignored, not judged
    assert digests_of(m2.logical, m2.leaves) is None
    for bad in ({"algorithm": "sk-logical-1", "digests": "abc"}, {"digests": ""}, [1], {"algorithm": 1}):
        with pytest.raises(CorruptCheckpointError, match="logical member"):
            Manifest.loads(json.dumps({**doc, "logical": bad}).encode())
    one = doc["logical"]["digests"].split(",")[0]
    assert member_problem({"algorithm": "sk-logical-1", "digests": one}, m.leaves) is not None  # one per leaf


def test_inspect_json_shows_each_leafs_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _manifest(tmp_path)
    assert cli_main(["inspect", str(tmp_path / "root"), "1", "--json"]) == 0
    leaves = {leaf["key"]: leaf for leaf in json.loads(capsys.readouterr().out)["leaves"]}
    assert leaves["w"]["logical_digest"] == logical_digest(tensor_of(torch.float32, (8, 5), 1))
    assert "logical_digest" not in leaves["n"]


@pytest.mark.parametrize(
    "options",
    [{}, {"compression": "zstd", "incremental": True}, {"max_files_per_rank": 3, "min_file_bytes": 1}],
    ids=["plain", "codecs", "files"],
)
def test_a_save_records_every_leafs_digest(tmp_path: Path, options: dict[str, Any]) -> None:
    """Many small tensors and large ones (whole blocks), compressed slabs and references to
    the previous step's chunks: every leaf's digest is its tensor's."""
    state = {f"small/{i}": tensor_of(DTYPES[i % len(DTYPES)], (i % 5, 3), i) for i in range(40)}
    state["big"] = tensor_of(torch.bfloat16, (700, 1024), 5)
    state["wide"] = tensor_of(torch.float32, (3, 100_000), 6)
    with CheckpointManager(tmp_path / "root", **options) as mgr:
        for step in (1, 2):  # the second save references the first's chunks (incremental)
            mgr.save(step, state, async_save=False)
            m = mgr.manifest(step)
            got = digests_of(m.logical, m.leaves)
            assert got == {k: logical_digest(v) for k, v in state.items()}, step


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_manifest_digests_equal_the_full_tensors_at_3_ranks(tmp_path: Path) -> None:
    res = run_workers(3, "logical_worker.py", str(tmp_path / "roots"), str(tmp_path / "results"), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"r{r}.json" for r in range(3)), output=res.stdout)
    expected = [
        f"{layout} {run}: every digest is the full tensor's"
        for layout in ("fsdp2", "tp")
        for run in ("enumerated", "described", "grouped")
    ]
    assert_checks(
        checks,
        [
            *expected,
            "fsdp2: the ranks' partials combine to the digest",
            "tp: the ranks' partials combine to the digest",
        ],
    )
