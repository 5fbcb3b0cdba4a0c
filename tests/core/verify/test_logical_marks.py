"""What a reader makes of the manifest's ``logical`` member beyond its digests (docs/format.md
6.1): a step committed with a ``replicas_disagree`` mark (``logical_check="warn"``) verifies
as readable with a warning, exit 0, and ``delete --damaged`` refuses it as intact, saying the
warning; a mark that is not a non-empty string of bounded length, a ``null`` member and a
malformed digest list are damage, the error naming what is wrong (the digest list: the entry
and its leaf). One process: steps saved by a real ``CheckpointManager``, their manifests
edited."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest
import torch

from shardkeeper.core import CheckpointManager, metrics
from shardkeeper.core.errors import CorruptCheckpointError, StateMismatchError
from shardkeeper.core.format.layout import step_dir
from shardkeeper.core.format.logical_member import MARK, MARK_CHARS, combine_reports, tensor_keys
from shardkeeper.core.format.manifest import Manifest
from shardkeeper.core.save.replicas import judge

from .._builders import run_cli as run

SAID = "tensor 'model/w': the copy on rank(s) [1] differs from the one rank(s) [0] wrote"


def _save(root: Path) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(s, {"model": {"w": torch.full((4, 3), float(s)), "b": torch.arange(5.0)}, "n": s})


def _edit(root: Path, step: int, fn: Any) -> Path:
    path = root / step_dir(step) / "manifest.json"
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def _mark(value: object) -> Any:
    return lambda doc: doc["logical"].__setitem__(MARK, value)


def test_a_step_committed_with_a_replicas_mark_is_readable_with_a_warning(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "root"
    _save(root)
    _edit(root, 2, _mark(SAID))
    code, out, err = run(capsys, "verify", root, "2")
    assert code == 0, out + err
    assert "step 2: OK, with 1 warning(s) (" in out and "DAMAGED" not in out, out
    assert "  - warning: step 2 was committed with logical_check='warn'" in out and SAID in out, out
    assert "no damage" in err and "1 warning(s)" in err, err
    code, out, _ = run(capsys, "verify", root, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"], doc
    step2 = doc["steps"][1]
    assert step2["ok"] and step2["problems"] == [] and [w["kind"] for w in step2["warnings"]] == ["replicas"], step2
    assert doc["steps"][0]["warnings"] == []
    # not damage: delete --damaged refuses it as intact, and says the warning
    code, out, err = run(capsys, "delete", root, "2", "--damaged")
    assert code == 2 and "verifies intact" in err and "A warning, not damage" in err and SAID in err, err
    assert "could not be checked" not in err and "storage" not in err, err
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("logical_check", ["error", "off"])
def test_a_restore_of_a_marked_step_warns_and_says_so_in_its_stats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, logical_check: Literal["error", "off"]
) -> None:
    """``restore()`` and ``load()`` of a step committed with the mark restore it (the written
    copies), with a warning naming the root, the step, the mark's tensors and ranks, and what
    to do; ``last_restore_stats.replicas_disagree`` holds the mark. A step without it: none."""
    root = tmp_path / "root"
    _save(root)
    _edit(root, 2, _mark(SAID))
    state: dict[str, Any] = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5)}, "n": 0}
    with CheckpointManager(root, logical_check=logical_check) as mgr, caplog.at_level(logging.WARNING):
        assert mgr.restore(state) == 2 and state["n"] == 2 and torch.equal(state["model"]["w"], torch.full((4, 3), 2.0))
        stats = mgr.last_restore_stats
        assert stats is not None and stats.replicas_disagree == SAID, stats
        said = [r.getMessage() for r in caplog.records if "disagreed" in r.getMessage()]
        assert len(said) == 1, said
        assert f"step 2 under {mgr.storage.url}" in said[0] and SAID in said[0], said
        assert "rank(s) [0] wrote" in said[0] and f"`shardkeeper verify {mgr.storage.url} 2`" in said[0], said
        caplog.clear()
        loaded = mgr.load(2)
        assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 2.0))
        said = [r.getMessage() for r in caplog.records if "disagreed" in r.getMessage()]
        assert len(said) == 1 and "load() of step 2" in said[0] and SAID in said[0], said
        caplog.clear()
        assert mgr.restore(state, step=1) == 1  # an unmarked step: no warning, no mark
        assert mgr.last_restore_stats is not None and mgr.last_restore_stats.replicas_disagree is None
        assert not [r for r in caplog.records if "disagreed" in r.getMessage()]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (5, "of type int"),
        ("", "a string of 0 characters"),
        ("x" * (MARK_CHARS + 1), f"a string of {MARK_CHARS + 1} characters"),
        ([SAID], "of type list"),
    ],
)
def test_a_malformed_mark_is_damage_that_names_it(tmp_path: Path, capsys: Any, value: object, said: str) -> None:
    root = tmp_path / "root"
    _save(root)
    path = _edit(root, 2, _mark(value))
    with pytest.raises(CorruptCheckpointError, match=f"its logical member's {MARK} mark is {said}, not a string of 1"):
        Manifest.loads(path.read_bytes(), where="step 2")
    code, out, _ = run(capsys, "verify", root, "2")
    assert code == 1 and f"{MARK} mark is {said}" in out, out


def test_the_writer_bounds_its_mark(tmp_path: Path) -> None:
    declared = {f"t{i:05d}": ["tensor", "float32", [1]] for i in range(2000)}
    keys = sorted(declared)
    reports = [
        {"rank": 0, "chunks": {"keys": keys, "logical": ",".join("1" for _ in keys)}},
        {
            "rank": 1,
            "chunks": {
                "keys": [],
                "logical": "",
                "replicas": {"keys": keys, "copies": [1] * len(keys), "sums": ",".join("2" for _ in keys)},
            },
        },
    ]
    member = combine_reports(reports, declared, [])
    assert member is not None
    mark = member[MARK]
    assert 0 < len(mark) <= MARK_CHARS and mark.endswith(" more tensor(s)") and "tensor 't00000'" in mark, mark[-200:]
    # The metric counts every tensor the mark stands for, those it only counts included.
    before = metrics.LOGICAL_MISMATCHES.total()
    judge(cast(Manifest, SimpleNamespace(logical=member, step=7)), "warn", 0)
    assert metrics.LOGICAL_MISMATCHES.total() - before == 2000


def test_a_bytes_leaf_whose_copies_disagree_is_named_as_one(tmp_path: Path, capsys: Any) -> None:
    """A bytes leaf's copies are compared as a tensor's are; the mark, the save's refusal and
    the metric name it as a bytes leaf, with advice for bytes, not for a tensor; so does
    ``verify``'s warning of a step committed with such a mark."""
    declared = {"b": ["bytes", "uint8", [3]], "model/w": ["tensor", "float32", [2]]}
    writer = {"rank": 0, "chunks": {"keys": ["b", "model/w"], "logical": "5,7"}}
    copy = {"keys": ["b", "model/w"], "copies": [1, 1], "sums": "6,7"}  # (its bytes differ, its tensor agrees)
    member = combine_reports(
        [writer, {"rank": 1, "chunks": {"keys": [], "logical": "", "replicas": copy}}], declared, []
    )
    assert member is not None
    assert member[MARK] == "bytes leaf 'b': the copy on rank(s) [1] differs from the one rank(s) [0] wrote", member
    before = metrics.LOGICAL_MISMATCHES.total()
    with pytest.raises(StateMismatchError) as e:
        judge(cast(Manifest, SimpleNamespace(logical=member, step=7)), "error", 0)
    said = str(e.value)
    assert metrics.LOGICAL_MISMATCHES.total() - before == 1
    assert "step 7: copies of replicated bytes leaves disagree: bytes leaf 'b'" in said, said
    assert "these bytes differ between ranks" in said and "per-rank key" in said, said
    assert "tensor" not in said.replace("more tensor", ""), said  # (no tensor's advice)
    root = tmp_path / "root"
    _save(root)
    _edit(root, 2, _mark(member[MARK]))
    code, out, _ = run(capsys, "verify", root, "2")
    assert code == 0 and "although copies of replicated bytes leaves disagreed at the save: bytes leaf 'b'" in out, out


def test_a_null_logical_member_is_damage(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "root"
    _save(root)
    path = _edit(root, 2, lambda doc: doc.__setitem__("logical", None))
    with pytest.raises(CorruptCheckpointError, match="its logical member is null"):
        Manifest.loads(path.read_bytes(), where="step 2")
    code, out, _ = run(capsys, "verify", root, "2")
    assert code == 1 and "logical member is null" in out, out
    _edit(root, 2, lambda doc: doc.pop("logical"))  # absent: not recorded, not damage
    assert run(capsys, "verify", root, "2", "--logical")[0] == 0


def test_a_malformed_digest_names_its_entry_and_leaf(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "root"
    _save(root)
    m = Manifest.loads((root / step_dir(2) / "manifest.json").read_bytes())
    keys = tensor_keys(m.leaves)
    at = keys.index("model/w")

    def bad_entry(doc: dict[str, Any]) -> None:
        digests = doc["logical"]["digests"].split(",")
        digests[at] = "XYZ"
        doc["logical"]["digests"] = ",".join(digests)

    path = _edit(root, 2, bad_entry)
    with pytest.raises(CorruptCheckpointError, match=rf"digest {at} \(of leaf 'model/w'\) is 'XYZ', not 16 lowercase"):
        Manifest.loads(path.read_bytes(), where="step 2")
    path = _edit(root, 2, lambda doc: doc["logical"].__setitem__("digests", doc["logical"]["digests"] + ","))
    with pytest.raises(CorruptCheckpointError, match=rf"holds {len(keys) + 1} digest\(s\) for {len(keys)} tensor"):
        Manifest.loads(path.read_bytes(), where="step 2")
