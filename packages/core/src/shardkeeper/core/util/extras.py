"""Which of the core's extras brings a module a torch-free install can miss, and how to get it:
one table for the lazy imports of ``shardkeeper.core`` and the CLI's missing-module errors
(the README's table of extras lists the same)."""

from __future__ import annotations

#: top-level module -> the ``shardkeeper-core`` extra that installs it
EXTRA_OF = {
    "torch": "torch",
    "numpy": "torch",
    "s3fs": "s3",
    "gcsfs": "gcs",
    "zstandard": "zstd",
    "cryptography": "crypto",
    "prometheus_client": "metrics",
}


def install_hint(module: str) -> str:
    """The command that installs ``module`` (one of ``EXTRA_OF``). numpy alone is enough
    where numpy is all that is needed (export, verify), so it is named first."""
    extra = f"'shardkeeper-core[{EXTRA_OF[module]}]'"
    return f"pip install numpy (or {extra})" if module == "numpy" else f"pip install {extra}"


__all__ = ["EXTRA_OF", "install_hint"]
