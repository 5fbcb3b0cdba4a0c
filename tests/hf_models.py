"""A tiny GPT-2 and a tiny Llama built from small configs (nothing downloaded), saved by
transformers' own ``save_pretrained`` in several safetensors shards, for the ``load_hf`` tests
of every suite (needs transformers).

GPT-2 ties its LM head to the token embedding (``save_pretrained`` leaves ``lm_head.weight``
out) and keeps ``Conv1D`` weights as (in, out); the Llama is untied, with grouped-query
attention. ``reference`` is what ``from_pretrained`` makes of a folder in one process: the
state every sharded load is compared with, bit for bit. ``folder_bytes`` is the bytes of the
folder's tensors, the bound's unit.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ("gpt2", "llama")
#: Several shards per model (each about 1.4 MB of float32 tensors).
MAX_SHARD_SIZE = "400KB"


def build(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """A fresh ``kind`` model ("gpt2" or "llama") of random weights (``seed``) in ``dtype``."""
    import transformers

    torch.manual_seed(seed)
    model: Any
    if kind == "gpt2":
        gpt2 = transformers.GPT2Config(
            vocab_size=1024, n_positions=64, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(gpt2)
    elif kind == "llama":
        llama = transformers.LlamaConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(llama)
    else:
        raise ValueError(f"unknown model {kind!r}: gpt2 or llama")
    return model.to(dtype).eval()


def save(kind: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """``build(kind, seed, dtype)`` saved with ``save_pretrained`` into ``out`` in several shards."""
    model = build(kind, seed, dtype)
    kwargs: dict[str, Any] = {"max_shard_size": MAX_SHARD_SIZE}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # transformers < 5
        kwargs["safe_serialization"] = True
    model.save_pretrained(out, **kwargs)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    if len(set(index["weight_map"].values())) < 3:
        raise AssertionError(f"{out}: save_pretrained wrote fewer than 3 shards: {index['weight_map']}")
    return out


def reference(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model ``from_pretrained`` loads from ``folder`` in this one process."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def folder_bytes(folder: Path) -> int:
    """The bytes of the folder's tensors (its index's ``total_size``)."""
    return int(json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"])


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (a collective), a plain tensor as it is."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_bytes(tensors: Any) -> int:
    """The bytes of this rank's pieces of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``want`` whose tensor ``got`` lacks or holds with other bits, dtype or shape
    (``got``'s DTensors gathered first: a collective, in ``want``'s key order on every rank)."""
    bad = []
    for k, w in want.items():
        if k not in got:
            bad.append(f"{k} (missing)")
            continue
        g = full(got[k])
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            bad.append(k)
    return bad
