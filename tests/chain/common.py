"""What every hop of the cross-framework chain shares: the model, Adam's settings, the data,
the record of what a hop saved, and the per-hop checks (tests/chain/test_framework_chain.py).

Each hop's rank 0 writes ``OUT/hop<i>-saved.safetensors``: the full fp32 parameters, Adam's
``exp_avg``/``exp_avg_sq`` and its ``step`` (as a 1-element float32 tensor) per parameter FQN,
exactly as that framework held them when it saved; the next hop compares what it restored
against that file before it trains. Every rank writes ``OUT/hop<i>-r<rank>.json``: a list of
checks ``{"hop", "check", "ok", "detail"}``.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

IN_FEATURES, HIDDEN = 7, 5
ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
FQNS = ("inp.weight", "inp.bias", "out.weight", "out.bias")  # sizes 35, 5, 35, 7: none divides by 2 or 3
MOMENTS = ("exp_avg", "exp_avg_sq")
HOPS = ("deepspeed", "fsdp2", "lightning", "accelerate", "transformers", "plain")


def add_layers(module: nn.Module) -> None:
    """The one architecture: ``inp`` Linear(7, 5), tanh, ``out`` Linear(5, 7), as direct children
    (so the FQNs are the same in a plain module, an engine, a LightningModule and under DDP)."""
    module.inp = nn.Linear(IN_FEATURES, HIDDEN)
    module.out = nn.Linear(HIDDEN, IN_FEATURES)


def forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.out(torch.tanh(module.inp(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        add_layers(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self, x)


def adam(params: Any) -> torch.optim.Adam:
    return torch.optim.Adam(params, **ADAM)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step ``step`` on ``rank`` (any framework, any hop)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, IN_FEATURES, generator=g), torch.randn(4, IN_FEATURES, generator=g)


def loss_of(module: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return (module(x) - y).pow(2).mean()


def record(params: Mapping[str, torch.Tensor], states: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """``param/<fqn>``, ``exp_avg/<fqn>``, ``exp_avg_sq/<fqn>``, ``step/<fqn>`` from full fp32
    parameters and per-parameter Adam state (keyed by FQN)."""
    out: dict[str, torch.Tensor] = {}
    for fqn in FQNS:
        out[f"param/{fqn}"] = params[fqn].detach().float().clone().contiguous()
        st = states.get(fqn, {})
        for k in MOMENTS:
            if k in st:
                out[f"{k}/{fqn}"] = torch.as_tensor(st[k]).detach().clone().contiguous()
        if "step" in st:
            out[f"step/{fqn}"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().reshape(1).clone()
    return out


class Hop:
    """One hop's checks and files: ``hop.check(name, ok, detail)``; ``hop.write()`` at the end."""

    def __init__(self, index: int, out: str) -> None:
        self.index, self.out = index, out
        self.name = HOPS[index - 1]
        self.rank = int(os.environ.get("RANK", "0"))
        self.items: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.items.append(
            {"hop": f"{self.index}-{self.name}", "check": name, "ok": bool(ok), "detail": str(detail)[:2000]}
        )
        return bool(ok)

    def guard(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn``; an exception becomes a failed check (the results are still written)."""
        try:
            fn()
        except Exception as e:
            self.check(name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}")

    def path(self, index: int, suffix: str) -> str:
        return os.path.join(self.out, f"hop{index}-{suffix}")

    def write(self) -> None:
        with open(self.path(self.index, f"r{self.rank}.json"), "w") as f:
            json.dump(self.items, f, indent=1)

    # -- the assertions every hop makes ------------------------------------------------------
    def previous(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from safetensors.torch import load_file

        prev = self.index - 1
        with open(self.path(prev, "saved.json")) as f:
            return load_file(self.path(prev, "saved.safetensors")), json.load(f)

    def loaded(self, step: int | None, got: dict[str, torch.Tensor]) -> None:
        """What this hop restored: the previous hop's step, its parameters, moments and Adam step."""
        want, meta = self.previous()
        self.check(
            "restored the newest committed step, the one the previous hop saved",
            step == meta["step"],
            f"restored step {step}; previous hop saved step {meta['step']}",
        )
        names = [k for k in want if not k.startswith("step/")]
        bad = [k for k in names if k not in got or not torch.equal(got[k], want[k])]
        self.check(
            "parameters and Adam moments bit-exact vs the previous hop's save",
            len(names) == len(FQNS) * 3 and not bad,
            f"differ or missing: {bad} (of {len(names)})",
        )
        steps = {k: (float(got[k]) if k in got else None, float(v)) for k, v in want.items() if k.startswith("step/")}
        self.check(
            "Adam step restored equals the saved one",
            len(steps) == len(FQNS) and all(a == b for a, b in steps.values()),
            "restored vs saved: " + ", ".join(f"{k[5:]}: {a} vs {b}" for k, (a, b) in steps.items()),
        )

    def counter(self, what: str, value: int, expected: int, note: str = "") -> None:
        self.check(
            f"step count resumes: {what}, after the load, equals the step loaded",
            value == expected,
            f"{what} = {value}, step loaded = {expected}{note}",
        )

    def saved(
        self, before: list[int], after: list[int], expected: int, state: dict[str, torch.Tensor], what: str
    ) -> None:
        """The save just made: its step, the root's newest step, and the record for the next hop."""
        from safetensors.torch import save_file

        new = sorted(set(after) - set(before))
        self.check(
            "the save's step continues the step count (Accelerate: its save iteration)",
            new == [expected],
            f"new committed steps {new}, expected [{expected}] ({what})",
        )
        newest_before = max(before) if before else None
        newest = max(after) if after else None
        self.check(
            "the root's newest committed step increased and equals the step just saved",
            newest == expected and (newest_before is None or newest > newest_before),
            f"newest committed before {newest_before}, after {newest}; steps {after}; this save {new}",
        )
        if self.rank == 0:
            save_file(state, self.path(self.index, "saved.safetensors"))
            with open(self.path(self.index, "saved.json"), "w") as f:
                json.dump({"step": new[0] if len(new) == 1 else None, "steps_after": after}, f)


def run_hop(
    name: str,
    run: Callable[[Hop, str], None],
    setup: Callable[[], None] | None = None,
    teardown: Callable[[], None] | None = None,
) -> None:
    """A hop worker's ``main`` (``worker.py ROOT OUT``): ``setup``, then ``run(hop, root)`` with
    its failure recorded as a check, then the checks written and ``teardown``. The hop's number
    is its place in ``HOPS``."""
    import sys

    root, out = sys.argv[1], sys.argv[2]
    if setup is not None:
        setup()
    hop = Hop(HOPS.index(name) + 1, out)
    try:
        hop.guard("the hop ran to the end", lambda: run(hop, root))
    finally:
        hop.write()
        if teardown is not None:
            teardown()


def committed_steps(root: str) -> list[int]:
    """``CheckpointManager(root).steps()``: every rank calls it (creating a manager is a
    collective in a process group)."""
    from shardkeeper.core import CheckpointManager

    with CheckpointManager(root) as mgr:
        return mgr.steps()
