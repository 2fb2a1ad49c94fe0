"""Canonical tensor names (Hugging Face Llama names) shared by the GGUF and HF loaders: the
tensors one pipeline stage needs and the shape each must have."""

from __future__ import annotations

from runtime.model.config import ModelConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_SUFFIXES = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_name(layer: int, suffix: str) -> str:
    """Canonical name of one decoder-layer tensor, e.g. ``model.layers.3.mlp.up_proj.weight``."""
    return f"model.layers.{layer}.{suffix}"


def stage_tensor_names(cfg: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """Canonical names a stage owning layers ``[start, end)`` loads (embeddings on the first stage,
    final norm + LM head on the last; a tied LM head reads the embedding tensor)."""
    start, end = layer_range
    names = [EMBED] if start == 0 else []
    names += [layer_name(i, s) for i in range(start, end) for s in LAYER_SUFFIXES]
    if end == cfg.num_layers:
        names.append(FINAL_NORM)
        if cfg.tie_word_embeddings and start != 0:
            names.append(EMBED)
        elif not cfg.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape ``name`` must have under ``cfg`` ([out_features, in_features] for linear weights)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    if name in (EMBED, LM_HEAD):
        return (cfg.vocab_size, h)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    return {
        FINAL_NORM: (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }[suffix]
