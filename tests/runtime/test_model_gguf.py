"""GGUF loading paths the default file does not exercise (untied ``output.weight``, linear rope
scaling metadata, llama.cpp ``rope_freqs.weight``), checked against transformers: a tiny random
Llama is written as an F32 GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does (Q/K permuted,
Llama 3 scaling turned into per-frequency divisors) and our logits must equal transformers' logits.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from runtime.model.batch_meta import BatchMeta
from runtime.model.stage import load_model_config, load_stage

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.permute`` (HF half-split rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.generate_extra_tensors`` (rope_freqs for Llama 3)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low, high = s["original_max_position_embeddings"] / s["low_freq_factor"], \
        s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, model, rope: dict | None) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if rope and rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope and rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(c.head_dim, 500000.0, rope))
    for i in range(c.num_hidden_layers):
        for hf, ours in LAYER.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if hf.endswith("q_proj"):
                t = llama_cpp_permute(t, c.num_attention_heads)
            elif hf.endswith("k_proj"):
                t = llama_cpp_permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
                         ids=["default", "linear", "llama3-rope_freqs"])
def test_untied_gguf_matches_transformers(tmp_path, rope):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_parameters={"rope_theta": 500000.0, **(rope or {"rope_type": "default"})},
                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, rope)
    ours_cfg = load_model_config(path)
    assert not ours_cfg.tie_word_embeddings and ours_cfg.num_layers == 3
    assert ours_cfg.rope_scaling == ({"rope_type": "linear", "factor": 4.0} if rope and
                                     rope["rope_type"] == "linear" else None)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    stages = [load_stage(path, r, max_num_reqs=1, max_model_len=48, progress=False)
              for r in ((0, 2), (2, 3))]
    meta = BatchMeta.build([0], [0], [40])
    hidden, residual = stages[0](meta, input_ids=ids)
    got = stages[1](meta, hidden=hidden, residual=residual)[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
