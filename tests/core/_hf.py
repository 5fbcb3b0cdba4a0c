"""A small model with a Hugging Face causal LM's names, and its weights written as an HF folder.

``TinyLM`` is named as ``LlamaForCausalLM`` is (``model.embed_tokens``, ``model.layers.N...``,
``model.norm``, ``lm_head`` tied to the embeddings), its projections in bfloat16 and the rest
in float32. ``write_folder`` writes a state with the ``safetensors`` package the way
``save_pretrained`` does: ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``, without the tied ``lm_head.weight``. ``CountingStorage``
counts the bytes read through it (the tests' bound on ranged reads).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from shardkeeper.core.storage import LocalStorage

INDEX = "model.safetensors.index.json"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim)
        for m in (self.q_proj, self.up_proj, self.down_proj):
            m.to(torch.bfloat16)


class TinyLM(nn.Module):
    def __init__(self, seed: int, *, vocab: int = 512, dim: int = 128, layers: int = 2, tie: bool = True) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.model.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state as ``save_pretrained`` writes it: copies, the tied ``lm_head`` left out."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def write_folder(tensors: Mapping[str, torch.Tensor], out: Path, shards: int = 3) -> Path:
    """``tensors`` as ``shards`` safetensors files and an index in ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class CountingStorage(LocalStorage):
    """Local storage that counts the bytes read through it, per file (header and data reads)."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.by_file: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.by_file[path] = self.by_file.get(path, 0) + n

    @property
    def bytes_read(self) -> int:
        return sum(self.by_file.values())

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        self._count(path, len(data))
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:  # read_range comes here too
        super().read_into(path, offset, buffer)
        self._count(path, len(buffer))
