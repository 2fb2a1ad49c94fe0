"""Canonical tensor names (Hugging Face names, one layout for every family) shared by the GGUF and
HF loaders: the tensors one pipeline stage needs and the shape each must have.

The decoder-layer tensors depend on the pieces of the config (:class:`ModelConfig`): q/k/v (and o)
biases, per-head q/k norms, and per layer either the dense SwiGLU MLP (``mlp.{gate,up,down}_proj``)
or the MoE MLP: the router ``mlp.gate.weight [E, H]`` and the experts *stacked* along a leading
expert axis, ``mlp.experts.{gate,up}_proj [E, I, H]`` and ``mlp.experts.down_proj [E, H, I]``
(the loaders build them from the per-expert tensors of an HF folder or read GGUF's stacked ones).
"""

from __future__ import annotations

from runtime.model.config import ModelConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
ATTN_SUFFIXES = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight")
DENSE_SUFFIXES = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
#: the tensors of a Llama layer without biases (the default model's layers)
LAYER_SUFFIXES = ATTN_SUFFIXES[:5] + ATTN_SUFFIXES[5:] + DENSE_SUFFIXES
QKV_BIAS_SUFFIXES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
O_BIAS_SUFFIX = "self_attn.o_proj.bias"
QK_NORM_SUFFIXES = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
ROUTER_SUFFIX = "mlp.gate.weight"
EXPERT_SUFFIXES = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def layer_name(layer: int, suffix: str) -> str:
    """Canonical name of one decoder-layer tensor, e.g. ``model.layers.3.mlp.up_proj.weight``."""
    return f"model.layers.{layer}.{suffix}"


def layer_suffixes(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The canonical suffixes of decoder layer ``layer`` under ``cfg``'s pieces."""
    out = list(ATTN_SUFFIXES)
    if cfg.qkv_bias:
        out += QKV_BIAS_SUFFIXES
    if cfg.o_bias:
        out.append(O_BIAS_SUFFIX)
    if cfg.qk_norm:
        out += QK_NORM_SUFFIXES
    out += (ROUTER_SUFFIX, *EXPERT_SUFFIXES) if cfg.is_moe_layer(layer) else DENSE_SUFFIXES
    return tuple(out)


def split_layer_name(name: str) -> tuple[int, str] | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``(3, "mlp.up_proj.weight")``; None for a global name."""
    if not name.startswith("model.layers."):
        return None
    _, _, layer, suffix = name.split(".", 3)
    return int(layer), suffix


def stage_tensor_names(cfg: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """Canonical names a stage owning layers ``[start, end)`` loads (embeddings on the first stage,
    final norm + LM head on the last; a tied LM head reads the embedding tensor)."""
    start, end = layer_range
    names = [EMBED] if start == 0 else []
    names += [layer_name(i, s) for i in range(start, end) for s in layer_suffixes(cfg, i)]
    if end == cfg.num_layers:
        names.append(FINAL_NORM)
        if cfg.tie_word_embeddings and start != 0:
            names.append(EMBED)
        elif not cfg.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape ``name`` must have under ``cfg`` ([out_features, in_features] for linear weights,
    ``[E, out, in]`` for stacked experts)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    e, mi = cfg.num_experts, cfg.moe_intermediate_size
    if name in (EMBED, LM_HEAD):
        return (cfg.vocab_size, h)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    return {
        FINAL_NORM: (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        ROUTER_SUFFIX: (e, h), "mlp.experts.gate_proj": (e, mi, h), "mlp.experts.up_proj": (e, mi, h),
        "mlp.experts.down_proj": (e, h, mi),
    }[suffix]
