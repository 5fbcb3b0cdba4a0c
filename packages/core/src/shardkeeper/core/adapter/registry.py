"""Find an installed framework adapter without importing it by name.

Adapters never import each other (each depends on the core alone), yet a Lightning or Accelerate run on
the DeepSpeed engine needs the DeepSpeed adapter's translation of the engine. Each adapter
registers its module as an entry point in the group ``shardkeeper.adapters``; a consumer asks
for it here by name, and gets a clear error naming the package to install when it is absent.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType

GROUP = "shardkeeper.adapters"

#: The distribution that provides each adapter, for the error message.
DISTRIBUTIONS = {
    "deepspeed": "shardkeeper-deepspeed",
    "lightning": "shardkeeper-lightning",
    "accelerate": "shardkeeper-accelerate",
}


def available_adapters() -> list[str]:
    """Names of the adapters installed in this environment."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=GROUP)})


def load_adapter(name: str) -> ModuleType:
    """The module of the installed adapter ``name`` (e.g. ``"deepspeed"``)."""
    eps = list(importlib.metadata.entry_points(group=GROUP, name=name))
    if not eps:
        dist = DISTRIBUTIONS.get(name, f"shardkeeper-{name}")
        raise ImportError(
            f"the shardkeeper adapter {name!r} is not installed (no entry point {name!r} in group "
            f"{GROUP!r}); install it with `pip install {dist}`. Installed adapters: "
            f"{', '.join(available_adapters()) or 'none'}"
        )
    module = eps[0].load()
    if not isinstance(module, ModuleType):
        raise ImportError(f"entry point {name!r} in group {GROUP!r} must name a module, got {module!r}")
    return module


__all__ = ["GROUP", "available_adapters", "load_adapter"]
