"""``load_hf`` of what transformers itself writes: a tiny Llama saved with ``save_pretrained``
in several safetensors shards (tied embeddings: ``lm_head.weight`` left out), loaded into a
fresh model bit for bit, and into a float32 model from a bfloat16 save with ``dtype=True``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from shardkeeper.core import load_hf  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _save(model: LlamaForCausalLM, out: Path) -> None:
    kwargs = {"max_shard_size": "60KB"}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # (transformers < 5)
        kwargs["safe_serialization"] = True
    model.save_pretrained(out, **kwargs)


def test_a_save_pretrained_llama_loads_bit_for_bit(tmp_path: Path) -> None:
    src = _llama(seed=0)
    _save(src, tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 3
    fresh = _llama(seed=1)
    got = load_hf(tmp_path / "hf", fresh)
    assert "model/lm_head.weight" not in got.keys  # omitted by save_pretrained, filled through its tie
    want = src.state_dict()
    for k, v in fresh.state_dict().items():
        assert v.dtype == want[k].dtype and torch.equal(v.view(torch.uint8), want[k].view(torch.uint8)), k
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, src(ids).logits)


def test_a_bfloat16_save_casts_into_a_float32_model(tmp_path: Path) -> None:
    src = _llama(seed=0).to(torch.bfloat16)
    _save(src, tmp_path / "hf")
    fresh = _llama(seed=1)
    load_hf(tmp_path / "hf", fresh, dtype=torch.float32)
    want = src.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k].float()), k
