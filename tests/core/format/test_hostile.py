"""Hostile checkpoints: a manifest from an untrusted root must fail with a CheckpointError
before any data is read, never open a file outside the root, never hang or exhaust memory.

Part (a) fuzzes the manifest parser with hypothesis (structure-aware mutations of a real
save's manifest, plus random bytes); part (b) checks each hostile class end to end through
``CheckpointManager.restore``, ``verify_step`` and the CLI with a storage that records every
path it touches.
"""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkeeper.core import CheckpointManager
from shardkeeper.core.cli import main as cli_main
from shardkeeper.core.errors import CheckpointError
from shardkeeper.core.format import manifest as manifest_format
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step

STEP = 1
STEP_DIR = "step-000000000001"
SENTINEL = "sentinel: never read me\n"


class RecordingStorage(LocalStorage):
    """A local root that records every path it is asked to read, and which reads hit data."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.paths: list[str] = []
        self.data_reads: list[str] = []

    def _note(self, path: str) -> None:
        self.paths.append(path)

    def size(self, path: str) -> int:
        self._note(path)
        return super().size(path)

    def exists(self, path: str) -> bool:
        self._note(path)
        return super().exists(path)

    def read_bytes(self, path: str) -> bytes:
        self._note(path)
        if not path.endswith("manifest.json"):
            self.data_reads.append(path)
        return super().read_bytes(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self._note(path)
        self.data_reads.append(path)
        return super().read_range(path, offset, length)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self._note(path)
        self.data_reads.append(path)
        super().read_into(path, offset, buffer)

    def escaped(self) -> list[str]:
        return [p for p in self.paths if p.startswith("/") or ":" in p or posixpath.normpath(p).startswith("..")]


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int64)},
        "extra": {"blob": b"hello bytes", "cfg": {"lr": 0.1, "names": ["a", "b"]}},
    }


def zero_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)},
        "extra": {"blob": b"", "cfg": {"lr": 0.0, "names": []}},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    root = tmp_path_factory.mktemp("hostile") / "root"
    mgr = CheckpointManager(root)
    mgr.save(STEP, make_state()).wait()
    mgr.close()
    return root, (root / STEP_DIR / "manifest.json").read_bytes()


@pytest.fixture()
def world(saved: tuple[Path, bytes], tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A fresh copy of the saved root (under tmp/outer/root) and a sentinel beside it."""
    import shutil

    src, raw = saved
    outer = tmp_path / "outer"
    root = outer / "root"
    shutil.copytree(src, root)
    sentinel = outer / "sentinel.txt"
    sentinel.write_text(SENTINEL)
    return root, sentinel, json.loads(raw)


def write_manifest(root: Path, doc: dict[str, Any] | bytes) -> None:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    (root / STEP_DIR / "manifest.json").write_bytes(data)


# ---------------------------------------------------------------------------------------------
# (b) each hostile class, end to end


def _first_chunk(d: dict[str, Any], key: str = "model/w") -> dict[str, Any]:
    return d["leaves"][key]["chunks"][0]


def _set_chunk(field: str, value: Any, key: str = "model/w") -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], sentinel: Path) -> None:
        _first_chunk(d, key)[field] = value(sentinel) if callable(value) else value

    return mutate


def _add_file(name: Callable[[Path], str]) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], sentinel: Path) -> None:
        d["files"][name(sentinel)] = {"size_bytes": len(SENTINEL), "rank": 0}

    return mutate


def _overlap(d: dict[str, Any], sentinel: Path) -> None:
    c = _first_chunk(d)  # w is [4, 3] float32: two [2, 3] boxes at rows 0 and 1 overlap
    a = dict(c, offsets=[0, 0], shape=[2, 3], length=24)
    b = dict(c, offsets=[1, 0], shape=[2, 3], length=24, offset=c["offset"] + 24)
    d["leaves"]["model/w"]["chunks"] = [a, b]


def _nested(depth: int) -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], sentinel: Path) -> None:
        v: Any = 1
        for _ in range(depth):
            v = [v]
        d["leaves"]["extra/cfg/names"]["value"] = v

    return mutate


def _leaf(field: str, value: Any, key: str = "model/w") -> Callable[[dict[str, Any], Path], None]:
    def mutate(d: dict[str, Any], sentinel: Path) -> None:
        d["leaves"][key][field] = value

    return mutate


def _bytes_leaf_huge(d: dict[str, Any], sentinel: Path) -> None:
    leaf = d["leaves"]["extra/blob"]
    n = 1 << 40  # a terabyte "bytes" leaf described by one 1 GiB-block chunk per digest
    d["digest_block_bytes"] = 1 << 30
    leaf["shape"] = [n]
    c = leaf["chunks"][0]
    leaf["chunks"] = [dict(c, length=n, shape=[n], digests=",".join(["0" * 32] * (n >> 30)))]


HOSTILE: dict[str, tuple[Callable[[dict[str, Any], Path], None], str]] = {
    "traversal-chunk": (_set_chunk("file", "../../sentinel.txt"), "not a path inside the root"),
    "traversal-step-ref": (_set_chunk("file", "../step-000000000000/../../sentinel.txt"), "not a path inside the root"),
    "traversal-data": (_set_chunk("file", "data/../../../sentinel.txt"), "not a path inside the root"),
    "traversal-files": (_add_file(lambda s: "../../sentinel.txt"), "not a path inside the root"),
    "absolute-chunk": (_set_chunk("file", lambda s: str(s)), "not a path inside the root"),
    "absolute-files": (_add_file(lambda s: str(s)), "not a path inside the root"),
    "url-file": (_set_chunk("file", lambda s: f"file://{s}"), "not a path inside the root"),
    "url-s3": (_set_chunk("file", "s3://bucket/x.safetensors"), "not a path inside the root"),
    "url-scheme-only": (_set_chunk("file", "http:sentinel.txt"), "not a path inside the root"),
    "backslash": (_set_chunk("file", "..\\..\\sentinel.txt"), "not a path inside the root"),
    "nul-byte": (_set_chunk("file", "data/x\x00.safetensors"), "not a path inside the root"),
    "non-string-file": (_set_chunk("file", ["data/x"]), "not a path inside the root"),
    # inside the root, but not a data file: a chunk may name only shard files
    "chunk-is-manifest": (_set_chunk("file", "manifest.json"), "to a data file"),
    "chunk-is-page": (_set_chunk("file", "pages/g00000-0123abcd.index.json"), "to a data file"),
    "chunk-is-other-manifest": (_set_chunk("file", "../step-000000000000/manifest.json"), "to a data file"),
    "chunk-is-data-dir": (_set_chunk("file", "../step-000000000000/data"), "to a data file"),
    "absurd-leaf-shape": (_leaf("shape", [10**18, 10**18]), "model/w"),
    "absurd-chunk-shape": (_set_chunk("shape", [10**12, 3]), "model/w"),
    "negative-shape": (_leaf("shape", [-4, -3]), "not a list of sizes"),
    "float-shape": (_set_chunk("shape", [4.0, 3.0]), "non-negative integers"),
    "absurd-length": (_set_chunk("length", 10**15), "digests"),
    "absurd-length-unlisted-file": (
        lambda d, s: (d["files"].clear(), _first_chunk(d).update(length=10**15)),
        "digests",
    ),
    "negative-byte-offset": (_set_chunk("offset", -8), "out of range"),
    "negative-global-offset": (_set_chunk("offsets", [-1, 0]), "non-negative integers"),
    # found by test_fuzz_end_to_end_restore_never_escapes (a TypeError deep in restore before)
    "null-global-offset": (_set_chunk("offsets", [None], key="model/b"), "non-negative integers"),
    "box-outside-tensor": (_set_chunk("offsets", [3, 0]), "outside"),
    "overlapping-boxes": (_overlap, "overlap"),
    "beyond-file-end": (_set_chunk("offset", 10**9), "[1000000000, 1000000048) lies beyond the end of"),
    "unknown-dtype": (_leaf("dtype", "float128"), "unknown dtype"),
    "unhashable-dtype": (_leaf("dtype", ["float32"]), "malformed"),
    "unknown-encoding": (_set_chunk("encoding", "zstd"), "encoding"),
    "unknown-kind": (_leaf("kind", "pickle"), "unknown leaf kind"),
    "bytes-leaf-terabyte": (_bytes_leaf_huge, "beyond the end of"),
    "nested-object-value": (_nested(150), "nested deeper"),
    "block-size-absurd": (lambda d, s: d.update(digest_block_bytes=1 << 50), "digest_block_bytes"),
    "files-not-object": (lambda d, s: d.update(files=[["data/x", {}]]), "malformed"),
    "prefixes-not-list": (lambda d, s: d.update(per_rank_prefixes="rng"), "malformed"),
}

RAW_HOSTILE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "deep-nesting-100k": (lambda raw: raw[:-1] + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON"),
    "huge-integer": (lambda raw: raw.replace(b'"step":1,', b'"step":' + b"9" * 5000 + b","), "not valid JSON"),
    "nan-constant": (lambda raw: raw[:-1] + b',"x":NaN}', "not valid JSON"),
    "infinity-step": (lambda raw: raw.replace(b'"step":1,', b'"step":Infinity,'), "not valid JSON"),
    "not-utf8": (lambda raw: b"\xff\xfe" + raw, "not valid JSON"),
    "not-an-object": (lambda raw: b"[" + raw + b"]", "format_version"),
}


def _restore_fails(root: Path, sentinel: Path, expect: str) -> RecordingStorage:
    storage = RecordingStorage(root)
    target = zero_state()
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(storage).restore(target, step=STEP)
    msg = str(info.value)
    assert expect in msg, msg
    assert STEP_DIR in msg and ("restore another step" in msg or "restore an earlier step" in msg), msg
    assert storage.data_reads == [], storage.data_reads  # refused before any data was read
    assert storage.escaped() == [], storage.escaped()
    assert torch.equal(target["model"]["w"], torch.zeros(4, 3))
    assert sentinel.read_text() == SENTINEL
    return storage


def _verify_and_cli_fail(root: Path, sentinel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = RecordingStorage(root)
    refused = False
    try:
        report = verify_step(storage, STEP)
    except CheckpointError:
        refused = True
        assert storage.data_reads == []  # refused at the manifest
    else:
        assert not report.ok  # the manifest is consistent, the files disagree with it
    assert storage.escaped() == []
    assert cli_main(["verify", str(root), str(STEP)]) != 0
    rc = cli_main(["inspect", str(root), str(STEP)])  # reads no data: fails only on a bad manifest
    assert (rc != 0) == refused
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert sentinel.read_text() == SENTINEL


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_manifest_is_refused_before_any_read(
    case: str, world: tuple[Path, Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, sentinel, doc = world
    mutate, expect = HOSTILE[case]
    mutate(doc, sentinel)
    write_manifest(root, doc)
    _restore_fails(root, sentinel, expect)
    _verify_and_cli_fail(root, sentinel, capsys)


@pytest.mark.parametrize("case", list(RAW_HOSTILE))
def test_hostile_manifest_bytes_are_refused(
    case: str,
    world: tuple[Path, Path, dict[str, Any]],
    saved: tuple[Path, bytes],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, sentinel, _ = world
    mutate, expect = RAW_HOSTILE[case]
    raw = saved[1]
    assert b'"step":1,' in raw
    write_manifest(root, mutate(raw))
    _restore_fails(root, sentinel, expect)
    _verify_and_cli_fail(root, sentinel, capsys)


def test_huge_manifest_is_refused_before_it_is_read(
    world: tuple[Path, Path, dict[str, Any]], saved: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, sentinel, _ = world
    monkeypatch.setattr(manifest_format, "MAX_MANIFEST_BYTES", len(saved[1]) - 1)
    storage = _restore_fails(root, sentinel, "more than the")
    assert not any(p.endswith("manifest.json") for p in storage.paths if p != f"{STEP_DIR}/manifest.json")
    with pytest.raises(CheckpointError, match="more than the"):
        Manifest.loads(saved[1], where="x")


def test_the_untouched_checkpoint_restores(world: tuple[Path, Path, dict[str, Any]]) -> None:
    """The fixture itself is sound: the hostile cases fail because of their mutation."""
    root, sentinel, _ = world
    storage = RecordingStorage(root)
    target = zero_state()
    CheckpointManager(storage).restore(target, step=STEP)
    want = make_state()
    assert torch.equal(target["model"]["w"], want["model"]["w"])
    assert target["extra"]["blob"] == want["extra"]["blob"]
    assert storage.escaped() == [] and storage.data_reads


# ---------------------------------------------------------------------------------------------
# (a) fuzzing the parser

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            "../../sentinel.txt",
            "/etc/passwd",
            "s3://b/k",
            "data/../../x",
            "C:\\x",
            "float128",
            "raw",
            "zstd",
            "tensor",
            "bytes",
            "object",
            "data/x.safetensors",
            "",
            ",",
        ]
    ),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in the document (dict keys and list indices), the root excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _apply(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> None:
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "replace":
        parent[last] = value
    elif op == "wrap":
        parent[last] = [parent[last]]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(parent[last]))
    elif op == "negate" and type(parent[last]) is int:
        parent[last] = -parent[last] - 1
    elif op == "huge" and type(parent[last]) is int:
        parent[last] = parent[last] * 10**15 + 10**18


def _parse_ok_or_checkpoint_error(data: bytes) -> None:
    try:
        m = Manifest.loads(data, where="fuzz")
    except CheckpointError:
        return
    assert m.problem() is None
    # What readers touch next must not blow up either.
    for key in m.leaves:
        leaf = m.leaves[key]
        assert leaf.nbytes >= 0
    m.referenced_files()


FUZZ = settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@FUZZ
@given(data=st.data())
def test_fuzz_structured_mutations(saved: tuple[Path, bytes], data: st.DataObject) -> None:
    doc = json.loads(saved[1])
    paths = _paths(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(["replace", "replace", "delete", "wrap", "duplicate", "negate", "huge"]))
        value = data.draw(JSON_VALUES) if op == "replace" else None
        try:
            _apply(doc, path, op, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or retyped the location
    _parse_ok_or_checkpoint_error(json.dumps(doc).encode())


@FUZZ
@given(data=st.data())
def test_fuzz_random_bytes(saved: tuple[Path, bytes], data: st.DataObject) -> None:
    raw = bytearray(saved[1])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        if op == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[i : i + data.draw(st.integers(1, 8))]
        else:
            del raw[i:]
        if not raw:
            break
    _parse_ok_or_checkpoint_error(bytes(raw))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_end_to_end_restore_never_escapes(
    saved: tuple[Path, bytes], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Mutated manifests on disk: restore succeeds or raises a CheckpointError; no path escapes."""
    import shutil

    outer = tmp_path_factory.mktemp("e2e")
    root = outer / "root"
    shutil.copytree(saved[0], root)
    sentinel = outer / "sentinel.txt"
    sentinel.write_text(SENTINEL)
    doc = json.loads(saved[1])
    leaf_paths = [p for p in _paths(doc) if p[0] in ("leaves", "files", "digest_block_bytes")]
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(leaf_paths))
        op = data.draw(st.sampled_from(["replace", "delete", "negate", "huge", "duplicate"]))
        try:
            _apply(doc, path, op, data.draw(JSON_VALUES) if op == "replace" else None)
        except (KeyError, IndexError, TypeError):
            pass
    write_manifest(root, doc)
    storage = RecordingStorage(root)
    try:
        CheckpointManager(storage).restore(zero_state(), step=STEP)
    except CheckpointError:
        pass
    assert storage.escaped() == []
    assert sentinel.read_text() == SENTINEL
