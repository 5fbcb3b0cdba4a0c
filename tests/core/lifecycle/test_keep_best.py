"""Retention's ``keep_best=(n, metric, mode)``: the n best committed steps by a number saved in
their metadata, besides ``keep_last`` / ``keep_every``; never the newest deleted; a step
without the metric is not best (warned once); ranked from the manifests retention reads
anyway. On real local roots, the kept steps restore bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardkeeper.core import CheckpointManager
from shardkeeper.core.format.manifest import MANIFEST_NAME
from shardkeeper.core.lifecycle.best import MissingMetricWarning, best_steps
from shardkeeper.core.lifecycle.retention import RetentionPolicy, apply_retention
from shardkeeper.core.storage import LocalStorage
from tests.checks import assert_same_state, state_of
from tests.core._builders import tensor, write_step

# -- the policy -------------------------------------------------------------------------------


def test_the_best_are_ranked_by_the_metric_ties_to_the_older_step() -> None:
    meta = {1: {"loss": 0.5}, 2: {"loss": 0.2}, 3: {"loss": 0.9}, 4: {"loss": 0.2}, 5: {"loss": 0.7}}
    assert best_steps((2, "loss", "min"), meta, meta) == {2, 4}
    assert best_steps((1, "loss", "min"), meta, meta) == {2}  # a tie: the older one stays
    assert best_steps((2, "loss", "max"), meta, meta) == {3, 5}
    assert best_steps((9, "loss", "min"), meta, meta) == set(meta)
    policy = RetentionPolicy(keep_last=1, keep_every=3, keep_best=(1, "loss", "max"))
    assert not policy.keeps_all
    assert policy.retained(meta, meta) == {5, 3}  # the union: the newest, the multiple of 3, the best
    assert policy.retained(meta) == set(meta)  # without the metadata any step may be best: all kept
    assert policy.by_count(meta) == {5, 3}
    assert not RetentionPolicy(keep_best=(1, "loss", "min")).keeps_all
    assert RetentionPolicy(keep_best=(1, "loss", "min")).retained(meta, meta) == {2}


def test_a_step_without_the_metric_is_not_best_and_warned_about_once() -> None:
    meta: dict[int, dict[str, Any]] = {
        1: {"loss": 0.1},
        2: {},
        3: {"loss": "0.05"},
        4: {"loss": True},
        5: {"loss": float("nan")},
        6: {"loss": 0.3},
    }
    with pytest.warns(MissingMetricWarning, match=r"step\(s\) 2, 3, 4, 5 under ROOT-A have no number 'loss'") as w:
        assert best_steps((3, "loss", "min"), meta, meta, "ROOT-A") == {1, 6}
    assert "metadata={'loss': value}" in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert best_steps((3, "loss", "min"), meta, meta, "ROOT-A") == {1, 6}  # once per root and metric
    with pytest.warns(MissingMetricWarning, match="ROOT-B"):
        best_steps((3, "loss", "min"), meta, meta, "ROOT-B")


@pytest.mark.parametrize(
    "value,error,match",
    [
        ((0, "loss", "min"), ValueError, r"RetentionPolicy.keep_best=\(0, 'loss', 'min'\): n must be >= 1"),
        ((2, "loss", "best"), ValueError, r"RetentionPolicy.keep_best=.*mode must be 'min'"),
        ((2, 5, "min"), TypeError, r"RetentionPolicy.keep_best=.*metric must be the name of a metadata key"),
        ("loss", TypeError, r"RetentionPolicy.keep_best='loss' is not a triple; pass keep_best=\(n, metric, mode\)"),
    ],
)
def test_a_bad_keep_best_names_the_field_and_the_form(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RetentionPolicy(keep_best=value)


# -- on a root ------------------------------------------------------------------------------


class CountingStorage(LocalStorage):
    """A local root that counts the manifest reads."""

    manifest_reads = 0

    def read_bytes(self, path: str) -> bytes:
        if path.endswith("/" + MANIFEST_NAME):
            self.manifest_reads += 1
        return super().read_bytes(path)


def test_retention_ranks_by_the_manifests_it_reads_anyway(tmp_path: Path) -> None:
    losses = {100: 0.9, 200: 0.1, 300: 0.5, 400: 0.3, 500: 0.8, 600: 0.7}
    reads = {}
    for name, policy in (
        ("last", RetentionPolicy(keep_last=2)),
        ("best", RetentionPolicy(keep_last=2, keep_best=(2, "loss", "min"))),
    ):
        storage = CountingStorage(tmp_path / name, fsync=False)
        for s, loss in losses.items():
            write_step(storage, s, {"model/w": tensor("float32", (4, 3), seed=s)}, metadata={"loss": loss})
        storage.manifest_reads = 0
        deleted = apply_retention(storage, policy)
        reads[name] = storage.manifest_reads
        assert deleted == ([100, 200, 300, 400] if name == "last" else [100, 300])
    assert reads["best"] == reads["last"], reads  # no read of its own


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def test_keep_best_on_a_real_root_keeps_the_best_and_they_restore_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    val = {10: 0.8, 20: 0.3, 30: 0.6, 40: 0.2, 50: 0.7, 60: 0.9, 70: 0.65}  # a made-up validation curve
    saved = {}
    with CheckpointManager(tmp_path, keep_last=1, keep_best=(2, "val_loss", "min"), save_every_steps=10) as mgr:
        for step in range(1, 71):
            _train_step(model, opt, step)
            if mgr.should_save(step):
                mgr.save(step, {"model": model, "optim": opt}, metadata={"val_loss": val[step]})
                saved[step] = state_of(model, opt)
        mgr.wait()
        assert mgr.steps() == [20, 40, 70]  # the two best and the newest; keep_last=1 is the newest
        assert mgr.manifest(40).metadata["val_loss"] == 0.2
    for step in (20, 40, 70):
        fresh = nn.Linear(8, 2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
        _train_step(fresh, fresh_opt, 999)  # optimizer state to be overwritten
        with CheckpointManager(tmp_path) as mgr:
            assert mgr.restore({"model": fresh, "optim": fresh_opt}, step=step) == step
        assert_same_state(state_of(fresh, fresh_opt), saved[step], what=f"step {step}")


def test_the_newest_stays_though_not_best_and_steps_without_the_metric_go(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0)}
    with CheckpointManager(tmp_path, keep_best=(1, "acc", "max"), async_save=False) as mgr:
        with pytest.warns(MissingMetricWarning, match=r"step\(s\) 1 under .* have no number 'acc'"):
            mgr.save(1, state)  # no metric: not best
            mgr.save(2, state, metadata={"acc": 0.9})
        assert mgr.steps() == [2]
        mgr.save(3, state, metadata={"acc": 0.5})  # worse, but the newest
        assert mgr.steps() == [2, 3]
        mgr.save(4, state, metadata={"acc": 0.95})
        assert mgr.steps() == [4]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once for this root and metric
            mgr.save(5, state)
            mgr.save(6, state, metadata={"acc": 0.1})
        assert mgr.steps() == [4, 6]
    with CheckpointManager(tmp_path) as mgr:  # without keep_best, retention keeps everything
        mgr.save(7, state).wait()
        assert mgr.steps() == [4, 6, 7]
