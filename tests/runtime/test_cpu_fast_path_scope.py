"""Which models the CPU fast path runs (runtime/model/cpu/fast_stage.py): the Llama/Mistral layer
only; every other piece of a family (biases, q/k norm, experts, yarn) is named, and the worker then
serves the model on the exact path instead of running it wrong."""

from __future__ import annotations

import pytest

from runtime.model.config import ModelConfig
from runtime.model.cpu.fast_stage import fast_path_unsupported
from runtime.model.errors import UnsupportedModelError

BASE = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def test_llama_layers_run_on_the_fast_path():
    assert fast_path_unsupported(ModelConfig(**BASE)) is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert fast_path_unsupported(ModelConfig(**BASE, rope_scaling=llama3)) is None


@pytest.mark.parametrize("update,named", [
    (dict(family="qwen2", qkv_bias=True), "family 'qwen2' with qkv bias"),
    (dict(family="qwen3", qk_norm=True), "family 'qwen3' with q/k norm"),
    (dict(family="qwen3_moe", qk_norm=True, num_experts=8, experts_per_token=2,
          moe_intermediate_size=32), "family 'qwen3_moe' with q/k norm, experts"),
])
def test_other_family_pieces_are_named(update, named):
    cfg = ModelConfig.model_construct(**{**ModelConfig(**BASE).model_dump(), **update})
    assert fast_path_unsupported(cfg) == named


def test_loading_an_unsupported_model_on_the_fast_path_is_refused(tmp_path, monkeypatch):
    from runtime.model.cpu import fast_stage
    cfg = ModelConfig.model_construct(**{**ModelConfig(**BASE).model_dump(), "family": "qwen2",
                                         "qkv_bias": True})
    monkeypatch.setattr(fast_stage, "open_checkpoint", lambda path: type("C", (), {"config": cfg})())
    monkeypatch.setattr(fast_stage, "resolve_model_path", lambda model: tmp_path)
    with pytest.raises(UnsupportedModelError, match="qkv bias; use --cpu-path exact"):
        fast_stage.load_fast_stage(tmp_path, (0, 1), max_num_reqs=1, max_model_len=16)
