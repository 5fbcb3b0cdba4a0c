"""What every test and worker uses to judge a run: the full-state compare and the check recorder.

``state_diff(got, want)`` compares two states leaf by leaf, bit for bit (tensors: the same
dtype, shape and bytes; other values: the same type and ``==``) and says what differs, first
keys first: missing and unexpected keys, type, dtype and shape mismatches, and for the first
differing tensors how many elements differ and the first one. ``state_of(model, optimizer)`` is the state a
resume test compares: parameters, buffers and optimizer state keyed by FQN, copied.

A worker records named checks in a ``Checks`` and writes them as one JSON list per rank
(``{"name", "ok", "rank", "detail"}``); the test reads them back with ``read_checks`` and
fails with every failed or missing check named by ``assert_checks``. Workers import this as
``tests.checks``: ``tests/worker_main.py`` puts the repository root on ``sys.path``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

LIMIT = 5  # keys listed per kind of difference


# -- the state and its compare ----------------------------------------------------------------


def state_of(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Copies of ``model``'s parameters (``param/<fqn>``) and buffers (``buffer/<fqn>``) and
    ``optimizer``'s state by parameter FQN (``optim/<fqn>/<name>``) and param groups
    (``optim/param_groups/<i>/...``, their ``params`` as FQNs). DTensors are gathered with
    ``full_tensor()``, a collective: every rank calls it. Without a model, parameters are
    named by position (``group<i>.param<j>``)."""
    out: dict[str, Any] = {}
    names: dict[int, str] = {}
    if model is not None:
        for k, v in model.state_dict(keep_vars=True).items():
            out[f"{'param' if isinstance(v, torch.nn.Parameter) else 'buffer'}/{k}"] = _copy(k, v)
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            fqns = []
            for pj, p in enumerate(group["params"]):
                if model is None:
                    names.setdefault(id(p), f"group{gi}.param{pj}")
                if id(p) not in names:
                    raise ValueError(f"state_of: parameter {pj} of param group {gi} is not a parameter of the model")
                fqns.append(names[id(p)])
                for k, v in optimizer.state.get(p, {}).items():
                    out[f"optim/{names[id(p)]}/{k}"] = _copy(f"{names[id(p)]}/{k}", v)
            for k, v in group.items():
                out[f"optim/param_groups/{gi}/{k}"] = fqns if k == "params" else _copy(k, v)
    return out


def deepspeed_full_state(engine: Any) -> dict[str, torch.Tensor]:
    """A DeepSpeed engine's full fp32 parameters and Adam moments, by FQN, through DeepSpeed's
    own API (``safe_get_full_*``; a collective under ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2
        # DeepSpeed links each parameter's view of the optimizer state once, after its first
        # step; under the transformers Trainer that link sees no state yet and never renews
        # ("exp_avg not found in optimizer state fragment"). Link to the current state.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        out[f"model/{n}"] = safe_get_full_fp32_param(p).detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{n}/{k}"] = safe_get_full_optimizer_state(p, k).detach().clone()
    return out


def _copy(key: str, v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return copy.deepcopy(v)
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    elif hasattr(v, "local_shards"):
        raise TypeError(f"state_of: {key} is a ShardedTensor; compare per rank with its local shards")
    return v.detach().clone()


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and sequences as one ``{"a/b/0": leaf}`` mapping (empty ones are leaves)."""
    if isinstance(state, Mapping) and state:
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(state, (list, tuple)) and state:
        out = {}
        for i, v in enumerate(state):
            out.update(flatten(v, f"{prefix}/{i}" if prefix else str(i)))
        return out
    return {prefix: state}


def state_diff(got: Any, want: Any, *, subset: bool = False, limit: int = LIMIT) -> str:
    """``""`` when ``got`` equals ``want`` bit for bit at every leaf, else what differs.

    Both are (nested) mappings of tensors and plain values. ``subset=True`` compares only the
    keys of ``want`` (``got`` may hold more). An empty ``want`` is a difference: a comparison
    of nothing proves nothing."""
    g, w = _flat(got), _flat(want)
    if not w:
        return "nothing to compare: the wanted state is empty"
    found: dict[str, list[str]] = {"missing": [k for k in w if k not in g]}
    found["unexpected"] = [] if subset else [k for k in g if k not in w]
    differing = set(found["missing"])
    for k in w:
        if k in g:
            kind, text = _leaf_diff(g[k], w[k])
            if kind:
                found.setdefault(kind, []).append(f"{k}: {text}")
                differing.add(k)
    bad = {kind: items for kind, items in found.items() if items}
    if not bad:
        return ""
    n = len(differing)
    extra = f", {len(found['unexpected'])} unexpected" if found["unexpected"] else ""
    lines = [f"{n} of {len(w)} wanted keys differ{extra}"]
    for kind in ("missing", "unexpected", "type", "dtype", "shape", "values"):
        items = bad.get(kind, [])
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            lines.append(f"  {kind}: " + "; ".join(items[:limit]) + more)
    return "\n".join(lines)


def _flat(state: Any) -> dict[str, Any]:
    return {} if isinstance(state, Mapping) and not state else flatten(state)


def assert_same_state(got: Any, want: Any, *, what: str = "state", subset: bool = False) -> None:
    """Raise ``AssertionError`` naming what differs unless ``got`` equals ``want`` bit for bit."""
    diff = state_diff(got, want, subset=subset)
    assert not diff, f"{what} differs from the wanted one:\n{diff}"


def _leaf_diff(a: Any, b: Any) -> tuple[str, str]:
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return "type", f"got {type(a).__name__}, want {type(b).__name__}"
    if not isinstance(a, torch.Tensor):
        if type(a) is not type(b):  # a restored 0.1 that became a tensor, an int that became a float
            return "type", f"got {type(a).__name__} {_short(a)}, want {type(b).__name__} {_short(b)}"
        return ("", "") if _plain_equal(a, b) else ("values", f"got {_short(a)}, want {_short(b)}")
    for t in (a, b):
        if hasattr(t, "full_tensor") or hasattr(t, "local_shards"):
            raise TypeError(f"state_diff: gather {type(t).__name__} leaves to full tensors before comparing")
    if a.dtype != b.dtype:
        return "dtype", f"got {a.dtype}, want {b.dtype}"
    if a.shape != b.shape:
        return "shape", f"got {list(a.shape)}, want {list(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    try:
        size = a.element_size()
        ab = a.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
        bb = b.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    except RuntimeError:  # sparse, quantized: no byte view
        return ("", "") if torch.equal(a, b) else ("values", "not equal (torch.equal)")
    neq = (ab != bb).any(dim=1)
    count = int(neq.sum())
    if not count:
        return "", ""
    first = int(neq.nonzero()[0, 0])
    where = [int(i) for i in torch.unravel_index(torch.tensor(first), a.shape)] if a.dim() else []
    got, want = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
    text = f"{count} of {a.numel()} elements differ, first at {where}: got {got!r}, want {want!r}"
    if a.is_floating_point():
        text += f" (max abs diff {(a.double() - b.double()).abs().nan_to_num(nan=float('inf')).max().item():.3g})"
    return "values", text


def _plain_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # bit for bit, as tensors compare
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an == that raises is a difference
        return False


def _short(v: Any, n: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


# -- the check recorder (workers) and its reader (tests) -----------------------------------------


class Checks:
    """Named pass/fail checks of one rank, written as a JSON list for the test to judge.

    ``check`` records one; ``same`` records a ``state_diff`` (the diff is the detail);
    ``run`` records whether a block ran through (its traceback if not); ``guard`` runs a
    block that records its own checks and records only its failure; ``skip`` says why the
    run could not be judged (``assert_checks`` then skips the test)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, rank: int | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.items: list[dict[str, Any]] = []

    def check(self, name: str, ok: object, detail: object = "", **extra: Any) -> bool:
        item: dict[str, Any] = {"name": name, "ok": bool(ok), "rank": self.rank, **extra}
        if not ok:
            item["detail"] = _text(detail) or "failed"
        self.items.append(item)
        return bool(ok)

    def same(self, name: str, got: Any, want: Any, *, subset: bool = False) -> bool:
        diff = state_diff(got, want, subset=subset)
        return self.check(name, not diff, diff)

    def run(self, name: str, fn: Callable[[], object]) -> bool:
        return self.guard(name, fn) and self.check(name, True)

    def guard(self, name: str, fn: Callable[[], object]) -> bool:
        try:
            fn()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - recorded: one launch judges many cases
            return self.check(name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return True

    def skip(self, name: str, reason: str) -> None:
        self.items.append({"name": name, "ok": True, "rank": self.rank, "skipped": _text(reason)})

    @property
    def names(self) -> set[str]:
        return {c["name"] for c in self.items}

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("Checks.write: no path given here or at construction")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.items, indent=1))
        return target


def _text(detail: object, limit: int = 4000) -> str:
    text = (
        detail if isinstance(detail, str) else repr(detail) if isinstance(detail, (list, tuple, dict)) else str(detail)
    )
    return text if len(text) <= limit else f"{text[: limit // 4]}\n[...]\n{text[-(limit * 3 // 4) :]}"


def read_checks(*paths: str | os.PathLike[str], output: str = "") -> list[dict[str, Any]]:
    """The checks the workers wrote at ``paths`` (every file must exist; ``output``, the
    launch's, goes into the message when one does not)."""
    if not paths:
        raise AssertionError(f"no result files to read\n{output[-4000:]}")
    out: list[dict[str, Any]] = []
    for p in paths:
        if not Path(p).exists():
            raise AssertionError(f"{p}: no results written (the worker died before writing them)\n{output[-4000:]}")
        out += json.loads(Path(p).read_text())
    return out


def assert_checks(checks: list[dict[str, Any]], expected: Iterable[str] = (), *, where: str = "") -> None:
    """Fail naming every failed check (with its detail) and every ``expected`` name some
    rank never recorded; skip the test if a worker recorded why it could not run."""
    head = f"{where}: " if where else ""
    skipped = [c for c in checks if c.get("skipped")]
    if skipped:
        import pytest

        pytest.skip(f"{head}{skipped[0]['name']}: {skipped[0]['skipped'][:500]}")
    assert checks, f"{head}no checks were recorded"
    want = list(dict.fromkeys(expected))
    by_rank: dict[Any, set[str]] = {}
    for c in checks:
        by_rank.setdefault(c.get("rank"), set()).add(c["name"])
    missing = {r: [n for n in want if n not in names] for r, names in sorted(by_rank.items(), key=str)}
    failed = [c for c in checks if not c["ok"]]
    lines = [
        f"- [rank {c.get('rank')}] {c['name']}: " + str(c.get("detail", "")).replace("\n", "\n    ") for c in failed
    ]
    lines += [f"- [rank {r}] never recorded: {names}" for r, names in missing.items() if names]
    if lines:
        never = ", some never ran" if any(missing.values()) else ""
        msg = f"{head}{len(failed)} of {len(checks)} checks failed{never}"
        raise AssertionError((msg + "\n" + "\n".join(lines))[:12000])
