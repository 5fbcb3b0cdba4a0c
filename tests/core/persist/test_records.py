"""The persist channel's JSON (``persist/records.py``): the core's records and plain values come
back equal; anything else is refused on the way out, and a forged record or tag on the way in."""

from __future__ import annotations

import math

import pytest
import torch

from shardkeeper.core import CheckpointOptions, LocalKeyProvider
from shardkeeper.core.format.grid import Mesh, Rule
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.persist.channel import decode, encode
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.save.plan import SavePlan, WriteItem


def test_records_and_values_come_back_equal() -> None:
    item = WriteItem("w", "float32", (4, 2), (0, 0), (4, 2), torch.zeros(4, 2), 32)
    plan = SavePlan(
        items=[item],
        declared={"w": ["tensor", "float32", [4, 2]]},
        layouts={"Tensor"},
        per_rank_keys={"rng/0"},
        described={"w": Rule(Mesh((2,), (0, 1)), (("shard", 0),), order=(0,))},
    )
    spec = PersistSpec("/r", {"anon": True}, CheckpointOptions(encryption=LocalKeyProvider(bytes(32), "k")), 1, 2)
    payload = {
        "plan": (plan, [[item]]),
        "spec": spec,
        "retention": RetentionPolicy(keep_last=2, keep_steps=frozenset({4})),
        "failures": {1: {"phase": "write"}},
        "blob": b"\x00\xff",
        "nan": math.inf,
    }
    kind, got = decode(encode("save", payload))
    assert kind == "save"
    (plan2, groups2) = got["plan"]
    assert plan2.items[0].src is None and groups2[0][0].key == "w"  # a tensor never crosses
    assert plan2.declared == plan.declared and plan2.layouts == {"Tensor"} and plan2.per_rank_keys == {"rng/0"}
    assert plan2.described == plan.described
    assert got["retention"] == payload["retention"] and got["failures"] == {1: {"phase": "write"}}
    assert got["blob"] == b"\x00\xff" and got["nan"] == math.inf
    key = got["spec"].options.encryption
    assert isinstance(key, LocalKeyProvider) and key.key_id == LocalKeyProvider(bytes(32)).key_id


def test_what_is_not_a_record_is_refused_both_ways() -> None:
    class Mine:
        pass

    with pytest.raises(TypeError, match="cannot cross"):
        encode("save", {"x": Mine()})
    with pytest.raises(ValueError, match="knows no record"):
        decode(b'["save", {"$r": "Popen", "f": {"args": "rm -rf /"}}]')
    with pytest.raises(ValueError, match="knows no tag"):
        decode(b'["save", {"$eval": "1"}]')
