"""State that differs per rank: ``PerRank`` values and the process's ``RNGState``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch


class PerRank:
    """Marks state that differs per rank (RNG, data position): stored as ``<key>/<rank>/...``."""

    def __init__(self, value: Any) -> None:
        self.value = value


class RNGState:
    """The calling process's RNG state: torch (CPU and CUDA), numpy, python ``random``.

    Per-rank by nature; put it in the state as ``{"rng": RNGState()}``.
    """

    __shardkeeper_per_rank__ = True

    def state_dict(self) -> dict[str, Any]:
        # The legacy (default) form: a tuple, as long as the global generator is MT19937.
        np_state = cast("tuple[str, np.ndarray[Any, Any], int, int, float]", np.random.get_state())
        py_state = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": {
                "kind": np_state[0],
                "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
            "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"].to(torch.uint8))
        n = sd["numpy"]
        np.random.set_state(
            (
                n["kind"],
                n["keys"].numpy().astype(np.uint32),
                int(n["pos"]),
                int(n["has_gauss"]),
                float(n["cached_gaussian"]),
            )
        )
        p = sd["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
        if "cuda" in sd and torch.cuda.is_available():
            states = [sd["cuda"][str(i)] for i in range(len(sd["cuda"]))]
            torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


__all__ = ["PerRank", "RNGState"]
