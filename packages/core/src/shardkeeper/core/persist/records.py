"""What crosses the persist channel, as JSON: no pickle, on either side.

JSON values go as they are (NaN and infinities included, as the state's object leaves may hold
them); what JSON lacks is tagged: ``{"$t": [...]}`` a tuple, ``{"$s": [...]}`` a set,
``{"$fs": [...]}`` a frozenset, ``{"$d": [[k, v], ...]}`` a dict whose keys are not all
strings, ``{"$b": base64}`` bytes, ``{"$key": base64, "source": ...}`` the core's
``LocalKeyProvider`` (the key the manager read), and ``{"$r": name, "f": {...}}`` one of the
records in ``RECORDS``, rebuilt from its fields by its own constructor (which checks them). A
tensor goes as None: its bytes travel through the shared staging buffer. A value of any other
type is a ``TypeError`` on the sending side; a tag or record name the reader does not know is a
``ValueError``: a forged message can make the other end build nothing but these records.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import torch

from shardkeeper.core.codec.keys import LocalKeyProvider
from shardkeeper.core.config.options import CheckpointOptions
from shardkeeper.core.format.grid import Mesh, Rule
from shardkeeper.core.lifecycle.retention import RetentionPolicy
from shardkeeper.core.persist.spec import PersistSpec
from shardkeeper.core.save.plan import SavePlan, WriteItem

#: The records a message may hold, by name: plain dataclasses of the core.
RECORDS: dict[str, type] = {
    cls.__name__: cls for cls in (PersistSpec, CheckpointOptions, SavePlan, WriteItem, Rule, Mesh, RetentionPolicy)
}


def _out(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return None
    if isinstance(v, list):
        return [_out(x) for x in v]
    if isinstance(v, tuple):
        return {"$t": [_out(x) for x in v]}
    if isinstance(v, frozenset):
        return {"$fs": [_out(x) for x in v]}
    if isinstance(v, set):
        return {"$s": [_out(x) for x in v]}
    if isinstance(v, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _out(x) for k, x in v.items()}
        return {"$d": [[_out(k), _out(x)] for k, x in v.items()]}
    if type(v) is LocalKeyProvider:
        kek, source = v.handover()
        return {"$key": base64.b64encode(kek).decode(), "source": source}
    name = type(v).__name__
    if RECORDS.get(name) is type(v):
        init = [f for f in dataclasses.fields(v) if f.init]  # type: ignore[arg-type]  # (a record: a dataclass)
        return {"$r": name, "f": {f.name: _out(getattr(v, f.name)) for f in init}}
    raise TypeError(f"a {type(v).__module__}.{name} cannot cross the persist channel")


def _in(v: Any) -> Any:
    if isinstance(v, list):
        return [_in(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "$t" in v:
        return tuple(_in(x) for x in v["$t"])
    if "$s" in v:
        return {_in(x) for x in v["$s"]}
    if "$fs" in v:
        return frozenset(_in(x) for x in v["$fs"])
    if "$d" in v:
        return {_in(k): _in(x) for k, x in v["$d"]}
    if "$b" in v:
        return base64.b64decode(v["$b"])
    if "$key" in v:
        return LocalKeyProvider(base64.b64decode(v["$key"]), str(v.get("source", "a key")))
    if "$r" in v:
        cls = RECORDS.get(str(v["$r"]))
        if cls is None:
            raise ValueError(f"the persist channel knows no record {v['$r']!r}")
        return cls(**{str(k): _in(x) for k, x in v["f"].items()})
    tags = [k for k in v if k.startswith("$")]
    if tags:
        raise ValueError(f"the persist channel knows no tag {tags[0]!r}")
    return {k: _in(x) for k, x in v.items()}


def dumps(value: Any) -> bytes:
    """``value`` as the channel's JSON (``TypeError`` for what cannot cross)."""
    return json.dumps(_out(value), allow_nan=True, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """The value ``dumps`` wrote (``ValueError`` for what is not such JSON)."""
    return _in(json.loads(data))


__all__ = ["RECORDS", "dumps", "loads"]
