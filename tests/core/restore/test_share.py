"""Replica-deduplicated restore (``restore/share.py``): the piece planning on its own,
and 4 real gloo ranks at replication 4, 2 and 1 (``dist/share_worker.py``): bit-exact, each
shared byte read from storage once (summed over the ranks, at most 1.05 x what the step's
files hold; about 4 x without sharing at replication 4), a flipped byte in a shared range
failing every rank as without sharing, a partial restore on one rank only, and an owner's
failed read (once: the others read the piece themselves; always: every rank raises).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardkeeper.core.restore.share import make_pieces
from tests.checks import assert_checks, read_checks

from .._launch import run_workers


def _needs(*rows: list[tuple[int, int, int]]) -> list[np.ndarray]:
    return [np.array(r, dtype=np.int64).reshape(-1, 3) for r in rows]


def test_pieces_cover_exactly_the_ranges_several_ranks_need() -> None:
    # rank 0: [0, 100) of file 7; rank 1: [50, 150); rank 2: [60, 70) and file 8 alone.
    pieces = make_pieces(_needs([(7, 0, 100)], [(7, 50, 150)], [(7, 60, 70), (8, 0, 10)]), 1 << 20, 1 << 30)
    got = [(p.fid, p.lo, p.hi, p.needers) for p in pieces]
    assert got == [(7, 50, 60, (0, 1)), (7, 60, 70, (0, 1, 2)), (7, 70, 100, (0, 1))]
    assert all(p.owner in p.needers for p in pieces)


def test_pieces_spread_owners_and_rounds() -> None:
    same = [(1, 0, 8000)]
    pieces = make_pieces(_needs(same, same, same, same), 1000, 3000)
    assert [(p.lo, p.hi) for p in pieces] == [(i, i + 1000) for i in range(0, 8000, 1000)]
    assert [p.owner for p in pieces] == [0, 1, 2, 3, 0, 1, 2, 3]  # reading spreads over the ranks
    assert [p.round for p in pieces] == [0, 0, 0, 1, 1, 1, 2, 2]  # at most 3000 bytes a round


def test_no_piece_when_nothing_is_shared() -> None:
    assert make_pieces(_needs([(1, 0, 10)], [(1, 10, 20)], [(2, 0, 10)]), 1 << 20, 1 << 30) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_deduplicated_restore_on_four_ranks(tmp_path: Path) -> None:
    res = run_workers(4, "share_worker.py", str(tmp_path), timeout_s=240)
    assert res.returncode == 0, res.stdout[-4000:]
    checks = read_checks(*(tmp_path / "results" / f"share-r{r}.json" for r in range(4)), output=res.stdout)
    expected = {
        f"replication {rep}{suffix}"
        for rep in (4, 2, 1)
        for suffix in (
            ": bit for bit",
            ": read <= 1.05 x the checkpoint",
            ": peers sent bytes",
            ", not shared: bit for bit",
            ", not shared: nothing received",
        )
    }
    expected |= {
        "replication 4, not shared: every rank read it all (control)",
        "flipped shared byte: every rank falls back to step 1",
        "flipped shared byte: fallback warns",
        "flipped shared byte: step 1 bit for bit",
        "flipped shared byte, step=2: raises on every rank",
        "partial on one rank: restored keys bit for bit",
        "partial on one rank: the others untouched",
        "owner read fails once: every rank restores",
        "owner read fails once: the fault was hit",
        "owner read fails always: every rank raises",
    }
    assert_checks(checks, expected)
    print(
        "bytes read from storage over the ranks / checkpoint bytes:", json.loads((tmp_path / "ratios.json").read_text())
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_rank_lost_mid_exchange_is_a_timeout_error_on_every_survivor(tmp_path: Path, mode: str) -> None:
    """Not a raw gloo error, and not after the training group's own timeout as well: each
    survivor raises CheckpointTimeoutError naming the step, its rank and the remedy."""
    res = run_workers(3, "share_peer_loss.py", str(tmp_path), mode, timeout_s=150)
    assert res.returncode == 0, res.stdout[-4000:]
    files = [tmp_path / "results" / f"loss-{mode}-r{r}.json" for r in (0, 2)]
    names = ["a CheckpointTimeoutError", "it names the step and this rank", "it names the remedy"]
    assert_checks(read_checks(*files, output=res.stdout), [*names, "within about commit_timeout_s"])
