"""``load_pretrained(engine, path)``: start a DeepSpeed engine from a Hugging Face safetensors folder."""

from __future__ import annotations

import os
from typing import Any

from shardkeeper.core import load_hf
from shardkeeper.deepspeed.state import ModelState


def load_pretrained(engine: Any, path: str | os.PathLike[str] | Any, **options: Any) -> Any:
    """Fill ``engine``'s model from the safetensors folder at ``path`` (a folder, a Hub cache
    folder, an fsspec URL or a ``Storage``) with ``shardkeeper.core.load_hf``, on every rank.

    The folder's tensors go into the fp32 master weights of ``engine_state(engine)["model"]``
    (each rank reads the byte ranges of its ZeRO partition), then into the module's own
    weights as a restore puts them there. ``options``: ``load_hf``'s (``rename``, ``dtype``,
    ``only``, ``tied``, ``strict``, ``storage_options``, ...); a bfloat16 or float16 folder
    needs ``dtype=True`` (a lossless cast into the fp32 masters). Returns ``load_hf``'s result.
    """
    return load_hf(path, {"model": ModelState(engine)}, prefix="model/", **options)


__all__ = ["load_pretrained"]
