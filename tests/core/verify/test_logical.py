"""``shardkeeper verify --logical``: each leaf's logical digest recomputed from the stored
chunks, without a model, and compared with the recorded one (docs/format.md 6.1). One
process: steps saved by a real ``CheckpointManager``, verified by the CLI and ``verify_step``."""

from __future__ import annotations

import base64
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.digest import digest_function
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.logical import box_sum
from shardkeeper.core.format.logical_member import digests_of, tensor_keys
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.format.records import ChunkRecord
from shardkeeper.core.storage import LocalStorage
from shardkeeper.core.verify.logical import ChunkSum, flat_boxes
from shardkeeper.core.verify.step import verify_step

from .._builders import run_cli as run

KEK = bytes(range(32))


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(48, 20, generator=g),
            "h": torch.randn(33, generator=g).to(torch.bfloat16),
            "i": torch.arange(20, dtype=torch.int64).reshape(4, 5) * seed,
            "s": torch.tensor(0.5 * seed),
        },
        "zeros": torch.zeros(64, 64),  # compresses
        "blob": b"a bytes leaf " * 40,
        "step": seed,
    }


def _save(root: Path, *steps: int, **options: Any) -> None:
    with CheckpointManager(root, async_save=False, **options) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


def _manifest(root: Path, step: int = 1) -> Manifest:
    return Manifest.loads((root / step_dir(step) / "manifest.json").read_bytes())


def _recorded(root: Path) -> dict[str, str | None]:
    m = _manifest(root)
    digests = digests_of(m.logical, m.leaves)
    assert digests is not None
    return digests


# -- a window of a chunk's bytes, summed as boxes ------------------------------------------------


def test_flat_boxes_cut_any_range_of_a_box_into_consecutive_boxes() -> None:
    for size in [(), (5,), (3, 4), (2, 3, 4), (3, 1, 2, 5), (4, 0, 3)]:
        n = math.prod(size)
        idx = np.arange(n).reshape(size)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            parts = list(flat_boxes(size, lo, hi))
            assert len(parts) <= max(1, 2 * len(size) - 1), (size, lo, hi, parts)
            flat = np.concatenate(
                [idx[tuple(slice(o, o + s) for o, s in zip(offs, shape))].reshape(-1) for offs, shape in parts]
            )
            assert flat.tolist() == list(range(lo, hi)), (size, lo, hi, parts)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_a_chunk_fed_in_any_windows_sums_to_its_boxs_sum(itemsize: int) -> None:
    """Windows that cut rows, elements and lanes: the sum is the whole box's."""
    rng = random.Random(itemsize)
    cases = [((9, 7), (2, 3), (5, 4)), ((6, 5, 4), (1, 0, 1), (4, 5, 2)), ((40,), (7,), (30,)), ((), (), ())]
    for shape, offsets, size in cases:
        numel = math.prod(size)
        data = bytes(rng.randrange(256) for _ in range(numel * itemsize))
        want = box_sum(data, itemsize, shape, offsets, size)
        c = ChunkRecord("data/x", 0, len(data), offsets, size, ())
        for window in [1, 3, itemsize, 7 * itemsize + 1, 64, len(data) or 1]:
            acc = ChunkSum(shape, c, itemsize)
            for at in range(0, len(data), window):
                acc.feed(memoryview(data)[at : at + window])
            assert acc.finish(None, "data/x", "k") and acc.total == want, (shape, offsets, size, window)
        short = ChunkSum(shape, c, itemsize)
        short.feed(memoryview(data)[: max(0, len(data) - 1)])
        assert not short.finish(None, "data/x", "k") or not data  # not read whole: not summed


# -- verify --logical on saved steps ---------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"max_files_per_rank": 3, "min_file_bytes": 1}], ids=["plain", "files"])
def test_a_clean_step_passes_with_every_digest_checked(tmp_path: Path, capsys: Any, options: dict[str, Any]) -> None:
    root = tmp_path / "root"
    _save(root, 1, digest_block_bytes=64, **options)  # 64-byte windows: rows and elements cut
    n = len(_recorded(root))
    assert n == 6 and all(_recorded(root).values())
    report = verify_step(LocalStorage(root), 1, logical=True, read_bytes=1)
    assert report.ok, report.problems
    assert report.logical is not None and (report.logical.checked, report.logical.not_checked) == (n, 0)
    code, out, _ = run(capsys, "verify", root, "--logical")
    assert code == 0 and "step 1: OK" in out and f"logical digests: {n} checked)" in out, out
    code, out, _ = run(capsys, "verify", root, "1", "--logical", "--json")
    step = json.loads(out)["steps"][0]
    assert code == 0 and step["logical"] == {"checked": n, "not_recorded": 0, "not_checked": 0, "algorithm": None}
    code, out, _ = run(capsys, "verify", root, "1", "--json")  # without --logical: as before
    assert code == 0 and "logical" not in json.loads(out)["steps"][0]


def test_an_edited_digest_is_damage_naming_the_tensor(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "root"
    _save(root, 1)
    path = root / step_dir(1) / "manifest.json"
    doc = json.loads(path.read_bytes())
    keys = tensor_keys(_manifest(root).leaves)
    digests = doc["logical"]["digests"].split(",")
    at = keys.index("model/w")
    real = digests[at]
    forged = digests[at] = format(int(real, 16) ^ 1, "016x")
    doc["logical"]["digests"] = ",".join(digests)
    path.write_text(json.dumps(doc))

    assert run(capsys, "verify", root)[0] == 0  # every chunk is intact: only --logical sees it
    code, out, err = run(capsys, "verify", root, "--logical")
    assert code == 1 and "step 1: DAMAGED (1 problem(s); logical digests: 6 checked)" in out, out
    assert (
        "tensor 'model/w' (float32 [48, 20])" in out
        and forged in out
        and real in out
        and "writer bug" in out
        and "earlier" in out
    )
    assert "1 problem(s)" in err
    code, out, _ = run(capsys, "verify", root, "1", "--logical", "--json")
    (p,) = json.loads(out)["steps"][0]["problems"]
    assert code == 1 and (p["kind"], p["key"], p["expected"], p["found"], p["step"]) == (
        "logical",
        "model/w",
        forged,
        real,
        1,
    )


def test_a_chunk_written_as_zeros_with_matching_digests_is_found(tmp_path: Path, capsys: Any) -> None:
    """What a writer bug commits: a piece's bytes zeroed, its block digests those of the zeros."""
    root = tmp_path / "root"
    _save(root, 1, digest_block_bytes=256)
    m = _manifest(root)
    c = m.leaves["model/w"].chunks[0]
    data = root / step_dir(1) / c.file
    raw = bytearray(data.read_bytes())
    raw[c.offset : c.offset + c.length] = bytes(c.length)
    data.write_bytes(bytes(raw))
    fn = digest_function(m.digest_algorithm)
    blocks = [fn(bytes(min(256, c.length - at))) for at in range(0, c.length, 256)]
    path = root / step_dir(1) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["leaves"]["model/w"]["chunks"][0]["digests"] = ",".join(blocks)
    path.write_text(json.dumps(doc))

    assert run(capsys, "verify", root)[0] == 0  # the chunk is what its digests say
    code, out, _ = run(capsys, "verify", root, "1", "--logical", "--json")
    (p,) = json.loads(out)["steps"][0]["problems"]
    assert code == 1 and (p["kind"], p["key"], p["expected"]) == ("logical", "model/w", _recorded(root)["model/w"])


def test_a_step_saved_without_digests_says_not_recorded(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "root"
    _save(root, 1, logical_check="off")
    assert _manifest(root).logical is None
    code, out, _ = run(capsys, "verify", root, "--logical")
    assert code == 0 and "logical digests: 0 checked, 6 not recorded" in out, out
    code, out, _ = run(capsys, "verify", root, "--logical", "--json")
    assert json.loads(out)["steps"][0]["logical"]["not_recorded"] == 6


def test_a_damaged_chunk_is_said_once_and_its_leaf_not_checked(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _save(root, 1)
    c = _manifest(root).leaves["model/w"].chunks[0]
    data = root / step_dir(1) / c.file
    raw = bytearray(data.read_bytes())
    raw[c.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    report = verify_step(LocalStorage(root), 1, logical=True)
    assert [p.kind for p in report.problems] == ["digest"] and report.problems[0].key == "model/w"
    assert report.logical is not None and (report.logical.checked, report.logical.not_checked) == (5, 1)


def test_compressed_encrypted_incremental_steps_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    pytest.importorskip("cryptography")
    pytest.importorskip("zstandard")
    monkeypatch.setenv("SK_TEST_KEK", base64.b64encode(KEK).decode())
    root = tmp_path / "root"
    options = {"compression": "zstd", "incremental": True, "encryption": "env:SK_TEST_KEK"}
    with CheckpointManager(root, async_save=False, **options) as mgr:  # type: ignore[arg-type]
        mgr.save(1, _state(1))
        mgr.save(2, {**_state(2), "zeros": _state(1)["zeros"]})  # zeros: step 1's chunk, referenced
        m2 = mgr.manifest(2)
    (zeros,) = m2.leaves["zeros"].chunks
    assert zeros.encoding != "raw" and zeros.file.startswith(f"../{step_dir(1)}/")
    code, out, _ = run(capsys, "verify", root, "--logical", "--key", "env:SK_TEST_KEK")
    assert code == 0 and out.count("logical digests: 6 checked)") == 2, out
    code, out, _ = run(capsys, "verify", root, "2", "--logical")  # without the key: no byte read
    assert code == 0 and "structure OK" in out and "logical digests: 0 checked, 6 not checked" in out, out
