"""Every JSON example of docs/format.md, read by the real reader and checks, so that the page
cannot drift from the code.

Each fenced ``json`` block parses (a member fragment such as ``"key": {...}`` as the object
it sits in) and is one of: a whole manifest, which loads, verifies and restores bit for bit
from files written as section 11 describes them (both forms of that step read as the same
leaves); or a member of such a manifest (a file, leaf or chunk record, the ``encryption``
member, a ``requires`` list), which the manifest of section 11 accepts in its place; or a
safetensors header entry, as the writer writes it. A block that is none of these fails.
"""

from __future__ import annotations

import json
import re
import struct
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkeeper.core import CheckpointManager, CorruptCheckpointError
from shardkeeper.core.format.features import FEATURES
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.safetensors import build_header, chunk_name
from shardkeeper.core.storage.local import LocalStorage
from shardkeeper.core.verify.step import verify_step
from tests.core._builders import make_bytes

DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"
STEP = "step-000000001200"


def json_blocks() -> list[tuple[int, str, Any]]:
    """(line, text, value) of every fenced ``json`` block, indented ones (in lists) included."""
    text = DOC.read_text()
    out = []
    for m in re.finditer(r"^( *)```json\n(.*?)^\1```", text, re.S | re.M):
        body = textwrap.dedent(m[2])
        try:
            value = json.loads(body)
        except ValueError:
            value = json.loads("{" + body + "}")  # a member fragment
        out.append((text.count("\n", 0, m.start()) + 1, body, value))
    return out


def kind_of(value: Any) -> str:
    if not isinstance(value, dict):
        return "unknown"
    if "format_version" in value:
        return "manifest"
    if "file" in value and "digests" in value:
        return "chunk"
    if len(value) != 1:
        return "unknown"
    ((key, member),) = value.items()
    if key in ("requires", "encryption"):
        return key
    if isinstance(member, dict) and "size_bytes" in member:
        return "file"
    if isinstance(member, dict) and "kind" in member:
        return "leaf"
    if isinstance(member, dict) and "data_offsets" in member:
        return "header-entry"
    return "unknown"


BLOCKS = json_blocks()
WEIGHT, RNG = make_bytes(24, 1), {0: make_bytes(16, 2), 1: make_bytes(16, 3)}


def _entries(rank: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    lo = 2 * rank
    return [
        (chunk_name("model/layers.0.weight", (lo, 0), (2, 3), (4, 3)), "bfloat16", (2, 3), 12),
        (f"rng/{rank}/torch", "uint8", (16,), 16),
    ]


def _example() -> tuple[str, dict[str, Any]]:
    """Section 11's manifest, the per-chunk form: its text and value."""
    (found,) = [(text, v) for _, text, v in BLOCKS if kind_of(v) == "manifest" and "leaf_table" not in v]
    return found


def _write_files(root: Path, doc: dict[str, Any]) -> None:
    text = DOC.read_text()
    for rank, (rel, rec) in enumerate(sorted(doc["files"].items())):
        header, at = build_header(_entries(rank), {"format": "pt", "writer": "shardkeeper"})
        assert at == [216, 228] and len(header) + 28 == rec["size_bytes"] == 244
        if rank == 0:
            quoted = re.search(r"^\{\"__metadata__\".*\}$", text, re.M)[0]  # type: ignore[index]
            assert header[:8] == struct.pack("<Q", 208) and header[8:].rstrip(b" ").decode() == quoted
        path = root / STEP / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(header + WEIGHT[12 * rank : 12 * rank + 12] + RNG[rank])


def test_every_json_block_is_a_manifest_or_a_member_of_one() -> None:
    kinds = [(line, kind_of(v)) for line, _, v in BLOCKS]
    assert not [line for line, k in kinds if k == "unknown"], f"examples no check covers, at lines {kinds}"
    got = sorted(k for _, k in kinds)
    assert got == sorted(
        ["manifest", "manifest", "file", "leaf", "leaf", "chunk", "header-entry", "encryption", "requires"]
    ), got


@pytest.mark.parametrize("form", ["per-chunk", "table"])
def test_the_example_manifests_parse_verify_and_restore_as_the_same_leaves(tmp_path: Path, form: str) -> None:
    """Section 11's step in both forms, with files written as its text describes (the data are
    the test builder's ``make_bytes``): every digest and both safetensors headers verify, and a
    restore gives the bytes back bit for bit."""
    manifests = {
        ("table" if "leaf_table" in v else "per-chunk"): text for _, text, v in BLOCKS if kind_of(v) == "manifest"
    }
    raw = manifests[form].encode()
    m = Manifest.loads(raw, where="docs/format.md")
    ref = Manifest.loads(manifests["per-chunk"].encode(), where="docs/format.md")
    assert m.requires == () and sorted(m.leaves) == sorted(ref.leaves)
    assert all(m.leaves[k].to_json() == ref.leaves[k].to_json() for k in ref.leaves)
    root = tmp_path / "root"
    _write_files(root, json.loads(raw))
    (root / STEP / "manifest.json").write_bytes(raw)
    report = verify_step(LocalStorage(root), 1200)
    assert report.ok and report.chunks_checked == 4, report.problems
    got = {"model": {"layers.0.weight": torch.zeros(4, 3, dtype=torch.bfloat16)}}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(got, only="model/*") == 1200
    want = torch.frombuffer(bytearray(WEIGHT), dtype=torch.bfloat16).reshape(4, 3)
    assert torch.equal(got["model"]["layers.0.weight"].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("line", [line for line, _, v in BLOCKS if kind_of(v) not in ("manifest", "header-entry")])
def test_each_member_example_fits_the_example_manifest(line: int) -> None:
    (value,) = [v for at, _, v in BLOCKS if at == line]
    kind = kind_of(value)
    _, doc = _example()
    if kind == "chunk":  # the rank 1 weight chunk, its encoding spelled out
        chunks = doc["leaves"]["model/layers.0.weight"]["chunks"]
        assert value == dict(chunks[1], encoding="raw")
        chunks[1] = value
    elif kind == "file":
        assert value.items() <= doc["files"].items()
    elif kind == "leaf":
        assert value.items() <= doc["leaves"].items()
    elif kind == "encryption":
        pytest.importorskip("cryptography")
        from shardkeeper.core.codec.crypto_manifest import manifest_section, seal_manifest
        from shardkeeper.core.codec.keys import LocalKeyProvider

        compact = json.dumps(doc, separators=(",", ":")).encode()
        sealed = seal_manifest(compact, LocalKeyProvider(bytes(32)), "/data/run")
        assert list(value["encryption"]) == list(manifest_section(sealed) or {}), "the members, in the written order"
        doc.update(requires=["encryption"], **value)
    elif kind == "requires":
        names = value["requires"]
        assert names == sorted(set(names)) and set(names) <= FEATURES
        doc.update(value)  # known features, whose members this step lacks: damage, not "upgrade"
        with pytest.raises(CorruptCheckpointError, match=f"requires '({'|'.join(names)})' but has no member"):
            Manifest.loads(json.dumps(doc).encode(), where="docs/format.md")
        return
    m = Manifest.loads(json.dumps(doc, ensure_ascii=False).encode(), where="docs/format.md")
    assert m.step == 1200


def test_the_header_entry_example_is_what_the_writer_writes() -> None:
    (value,) = [v for _, _, v in BLOCKS if kind_of(v) == "header-entry"]
    ((name, entry),) = value.items()
    header, _ = build_header(_entries(1), {"format": "pt", "writer": "shardkeeper"})
    written = json.loads(header[8:].rstrip(b" "))
    assert written[name] == entry
