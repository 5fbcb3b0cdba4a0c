"""JSON values (object leaves, metadata) come back exactly, or the save that holds them fails
at once, naming the key.

Non-finite floats and integers of any size round-trip (a best loss of ``inf``, numpy's PCG64
state, ``SeedSequence.entropy``, a 2**80 run id), in small and table-form manifests and
through a rank's report; a string or key that is not valid Unicode (a lone surrogate, from
``os.fsdecode`` of a non-UTF-8 name) is refused by ``save()``; the coordinator parses the
exact bytes it commits with the reader before the conditional put.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.errors import CheckpointSaveError, CorruptCheckpointError, StateMismatchError
from shardkeeper.core.format.columns import TABLE_MIN_CHUNKS
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.manifest import Manifest
from tests.core._launch import run_workers

BIG = 2**80


def _values() -> dict:
    rng = np.random.default_rng(1234)
    rng.random(3)  # a state in the middle of the stream
    return {
        "best_val_loss": float("inf"),
        "worst": float("-inf"),
        "undefined": float("nan"),
        "run_id": BIG,
        "neg": -(2**70),
        "u64_max": 2**64 - 1,
        "i64_min": -(2**63),
        "pcg64": rng.bit_generator.state,
        "entropy": np.random.SeedSequence(99).entropy,
        "nested": {"list": [1, 2.5, float("inf"), 2**100, "é ✓ 😀"]},
    }


def _blank(values: dict) -> dict:
    """A target of the same structure holding other values."""
    out = json.loads(json.dumps(values, allow_nan=True))
    out["pcg64"] = np.random.default_rng(0).bit_generator.state
    out["run_id"] = out["neg"] = out["u64_max"] = out["i64_min"] = out["entropy"] = 0
    out["best_val_loss"] = out["worst"] = out["undefined"] = 0.0
    out["nested"]["list"] = [0, 0.0, 0.0, 0, ""]
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("table", [False, True], ids=["per-chunk", "table"])
def test_non_finite_floats_and_big_integers_round_trip(tmp_path: Path, table: bool) -> None:
    n = TABLE_MIN_CHUNKS if table else 2
    tensors = {f"t{i}": torch.full((2,), float(i)) for i in range(n)}
    values = _values()
    with CheckpointManager(tmp_path, metadata={"run_id": BIG, "lr_floor": float("-inf")}) as mgr:
        mgr.save(1, {"tensors": tensors, "values": values}, metadata={"seed": 2**77, "score": float("nan")})
        mgr.wait()
        m = mgr.manifest(1)
        assert m.format_version == 1 and m.requires == ("extended-json",)
        assert m.metadata["run_id"] == BIG and type(m.metadata["run_id"]) is int
        assert m.metadata["seed"] == 2**77 and math.isnan(m.metadata["score"]) and m.metadata["lr_floor"] == -math.inf
        target = {"tensors": {k: torch.zeros(2) for k in tensors}, "values": _blank(values)}
        assert mgr.restore(target) == 1
    got = target["values"]
    want = json.loads(json.dumps(values, allow_nan=True))  # JSON's model: tuples are lists
    assert _same(want, got), (want, got)
    # numpy accepts the restored generator state and continues the *same* random stream
    rng = np.random.default_rng()
    rng.bit_generator.state = got["pcg64"]
    ref = np.random.default_rng(1234)
    ref.random(3)
    assert np.array_equal(rng.random(8), ref.random(8))
    assert all(torch.equal(target["tensors"][k], tensors[k]) for k in tensors)


def test_a_plain_checkpoint_requires_no_extended_values(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2), "loss": 0.5, "step": 2**62}, async_save=False)
        doc = json.loads((tmp_path / step_dir(1) / "manifest.json").read_bytes())
    assert doc["format_version"] == 1 and "requires" not in doc


@pytest.mark.multiprocess
def test_values_of_other_ranks_travel_exactly(tmp_path: Path) -> None:
    res = run_workers(2, "json_worker.py", str(tmp_path / "root"), str(tmp_path), timeout_s=180)
    assert res.returncode == 0, res.stdout[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got == {"ok": True}, (rank, got)


@pytest.mark.parametrize(
    ("state", "key"),
    [
        ({"paths": ["ok", "bad\udcff.bin"]}, "paths/1"),
        ({"args": {"name": "x\ud800y"}}, "args/name"),
        ({"names": {"f\udc80": 1}}, "names/f"),
        ({"t\udc81": torch.ones(1)}, "t"),
    ],
    ids=["value", "nested-value", "dict-key", "tensor-key"],
)
def test_a_lone_surrogate_is_refused_by_save_naming_the_key(tmp_path: Path, state: dict, key: str) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(1)}).wait()
        with pytest.raises(StateMismatchError) as e:
            mgr.save(2, state)
        assert (
            key in str(e.value)
            and "surrogate" in str(e.value)
            and ("fsencode" in str(e.value) or "rename" in str(e.value))
        )
        assert not (tmp_path / step_dir(2)).exists(), "the refused save wrote something"
        mgr.save(2, {"w": torch.ones(1)}).wait()  # nothing is stuck: later saves commit
        assert mgr.steps() == [1, 2]


def test_a_lone_surrogate_in_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StateMismatchError, match="metadata key 'argv/1'.*surrogate"):
        CheckpointManager(tmp_path, metadata={"argv": ["train.py", "--data=\udcffdir"]})
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError, match="metadata key 'env/HOME'"):
            mgr.save(1, {"w": torch.ones(1)}, metadata={"env": {"HOME": "/home/\udce9"}})
        mgr.save(1, {"w": torch.ones(1)}).wait()
        assert mgr.steps() == [1]


def test_the_coordinator_parses_what_it_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that loses a value (here: a dumps that writes big integers without requiring
    extended values, which a fast reader takes for floats) must fail the save, naming the
    key, instead of committing a step whose value comes back different."""

    def undeclared(self: Manifest, *, sealed: bool = False) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    monkeypatch.setattr(Manifest, "dumps", undeclared)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointSaveError, match="'seq/entropy'.*would not come back exactly"):
            mgr.save(1, {"w": torch.ones(1), "seq": {"entropy": BIG}}, async_save=False)
        assert mgr.steps() == []
        assert not (tmp_path / step_dir(1) / "manifest.json").exists()


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2), "loss": float("inf")}, async_save=False)
    path = tmp_path / step_dir(1) / "manifest.json"
    return path, json.loads(path.read_bytes().decode(), parse_constant=float)


@pytest.mark.parametrize("edit", ["undeclared", "by-a-member", "not-a-list"])
def test_extended_values_must_be_required(tmp_path: Path, edit: str) -> None:
    path, doc = _saved(tmp_path)
    assert doc["requires"] == ["extended-json"]
    if edit == "undeclared":
        del doc["requires"]
    elif edit == "by-a-member":  # an unknown optional field declares nothing
        del doc["requires"]
        doc["extended_json"] = True
    else:
        doc["requires"] = "extended-json"
    data = json.dumps(doc, allow_nan=True).encode()
    with pytest.raises(CorruptCheckpointError):
        Manifest.loads(data, where="edited")


def test_an_integer_no_reader_parses_is_refused_by_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError, match=r"'seed'.*4300 digits.*str\(n\)"):
            mgr.save(1, {"w": torch.ones(1), "seed": 2**20000})
        assert not (tmp_path / step_dir(1)).exists()
        mgr.save(1, {"w": torch.ones(1), "seed": 10**4299}).wait()  # 4300 digits: fine
        got = {"w": torch.zeros(1), "seed": 0}
        mgr.restore(got)
    assert got["seed"] == 10**4299


def test_a_lone_surrogate_in_a_top_level_metadata_key_is_refused_by_save(tmp_path: Path) -> None:
    key = "arg\udcff"
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError, match=r"metadata key 'arg\\udcff'.*surrogate"):
            mgr.save(1, {"w": torch.ones(1)}, metadata={key: 1})
        assert not (tmp_path / step_dir(1)).exists()
