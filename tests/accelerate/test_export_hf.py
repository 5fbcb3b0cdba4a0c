"""A transformers model saved through shardkeeper exports to a directory that
``AutoModelForCausalLM.from_pretrained`` loads, with identical logits (no download: a tiny
config built locally, HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardkeeper.core import CheckpointManager
from shardkeeper.core.tools.export import export_safetensors

transformers = pytest.importorskip("transformers", reason="transformers is installed in the adapters suites")

pytestmark = [pytest.mark.timeout(180)]


def test_exported_llama_loads_with_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # no two parameters alike, so a swapped name cannot pass
        for p in model.parameters():
            p.normal_(0, 0.5)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(10, {"model": model, "progress": {"step": 10}}, async_save=False)
    out = tmp_path / "hf"
    # small shards: from_pretrained must follow the index across files
    res = export_safetensors(tmp_path / "ckpt", to=out, max_shard_size="20KB", progress=False)
    assert len(res.files) > 1
    model.config.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    assert torch.equal(want, got)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
