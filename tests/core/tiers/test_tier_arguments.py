"""The tier keywords checked before anything is opened: ``erasure=`` takes any pair of ints
(a tuple, or a list as a JSON or YAML config gives it; numpy ints too), and every refusal
names the root, the rank and the remedy."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkeeper.core import CheckpointManager
from shardkeeper.core.tiers.strategy import TierSettings


def test_erasure_takes_any_pair_of_ints() -> None:
    """A tuple, a list (from a config), numpy ints and a numpy array all give the same pair."""
    for erasure in [(2, 1), [2, 1], (np.int64(2), np.int32(1)), np.array([2, 1])]:
        got = TierSettings.checked("/l", None, 0, None, erasure).erasure
        assert got == (2, 1) and type(got) is tuple and all(type(v) is int for v in got), erasure


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"erasure": 3}, TypeError, r"erasure must be a pair \(k, m\) of ints.*got int 3.*pass e\.g\. erasure=\(4, 1\)"),
    ({"erasure": "4,1"}, TypeError, r"erasure must be a pair \(k, m\) of ints.*got str '4,1'.*erasure=\(4, 1\)"),
    ({"erasure": (4, 1, 1)}, TypeError, r"erasure must be a pair \(k, m\) of ints.*got tuple of 3.*erasure=\(4, 1\)"),
    ({"erasure": {4, 1}}, TypeError, r"erasure must be a pair \(k, m\) of ints.*got set.*erasure=\(4, 1\)"),
    ({"erasure": (4.0, 1)}, TypeError, r"erasure=\(k, m\): k must be an int, got float 4\.0.*erasure=\(4, 1\)"),
    ({"erasure": ["4", 1]}, TypeError, r"erasure=\(k, m\): k must be an int, got str '4'.*erasure=\(4, 1\)"),
    ({"erasure": (4, True)}, TypeError, r"erasure=\(k, m\): m must be an int, got bool True.*erasure=\(4, 1\)"),
    ({"erasure": (0, 1)}, ValueError, r"k=0, but a group needs at least 1 data node; pass k >= 1"),
    ({"erasure": [3, 0]}, ValueError, r"m=0, but parity needs at least 1 node; pass m >= 1"),
    ({"erasure": (250, 7)}, ValueError, r"k \+ m = 257, but the code allows at most 256; lower k"),
    ({"erasure": [3, 1], "replicas": 1}, ValueError, r"replicas=1 and erasure=\(3, 1\) both protect.*pass one of"),
    ({"replicas": -1}, ValueError, r"replicas must be >= 0, got -1; pass replicas=1"),
    ({"replicas": "1"}, TypeError, r"replicas must be an int >= 0, got str '1'; pass replicas=1"),
    ({"persist_every": 0}, ValueError, r"persist_every must be >= 1 or None.*got 0; pass persist_every="),
    ({"local_keep": 1.5}, TypeError, r"local_keep must be an int >= 1 or None, got float 1\.5; pass local_keep="),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[repr(b[0]) for b in BAD])
def test_each_bad_tier_keyword_names_the_root_the_rank_and_the_remedy(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    p, local = tmp_path / "p", tmp_path / "l"
    with pytest.raises(error, match=rf"^{re.escape(str(p))}, rank 0: .*{message}"):
        CheckpointManager(p, local=local, **kwargs)
    assert not p.exists() and not local.exists()  # nothing opened


def test_tier_keywords_without_local_name_the_root_and_the_rank(tmp_path: Path) -> None:
    p = tmp_path / "p"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}, rank 0: .*configure the local tier; pass local="):
        CheckpointManager(p, erasure=[3, 1])
    assert not p.exists()
