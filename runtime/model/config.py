"""Model architecture configuration, read from GGUF metadata (``<arch>.*`` keys) or HF ``config.json``.

Which architectures are accepted, and the pieces each one's decoder layer uses, come from the family
declarations of :mod:`runtime.model.families` (one YAML file per architecture).
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from runtime.model.errors import UnsupportedModelError
from runtime.model.families.family import (Family, family_fields, family_for_gguf, family_for_hf,
                                           family_of)
from runtime.model.rope import SUPPORTED_ROPE_TYPES, rope_type

__all__ = ["ModelConfig", "rope_type", "SUPPORTED_ROPE_TYPES"]


class ModelConfig(BaseModel):
    """Shape, numerics and pieces of a decoder of one of the declared families.

    Attributes:
        architecture: the GGUF architecture (``llama``, ``qwen3moe``) or the HF class name, e.g.
            ``Qwen2ForCausalLM``.
        head_dim: per-head width; ``hidden_size // num_heads`` unless given.
        rope_scaling: None, ``{"rope_type": "linear", "factor": f}``, the Llama 3 form
            ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`` or ``yarn`` (``factor``, ``beta_fast``,
            ``beta_slow``, ``original_max_position_embeddings``, ...; HF conventions).
        family: the family declaration's name (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``,
            ``mixtral``).
        qkv_bias / o_bias: biases on the Q, K, V / O projections.
        qk_norm: per-head RMSNorm of q and k (weights ``[head_dim]``) before RoPE.
        num_experts, experts_per_token, moe_intermediate_size: the MoE MLP (0 experts: dense).
        moe_renormalize: top-k routing weights divided by their sum.
        moe_sparse_step, moe_dense_layers: see :meth:`is_moe_layer` (Qwen3-MoE's
            ``decoder_sparse_step`` / ``mlp_only_layers``).
    Raises:
        UnsupportedModelError: (at validation) a rope kind the family does not declare, inconsistent
            head sizes or MoE shape.
    """
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = False
    moe_sparse_step: int = 1
    moe_dense_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        rtype = rope_type(self.rope_scaling)
        kinds = [k for k in family_of(self.family).rope_kinds if k in SUPPORTED_ROPE_TYPES]
        if rtype not in kinds:
            raise UnsupportedModelError(
                f"config field 'rope_scaling.rope_type': {rtype!r} is not supported (supported: {kinds})")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise UnsupportedModelError(
                f"config field 'num_experts_per_tok': {self.experts_per_token} must be in "
                f"[1, {self.num_experts}] (the number of experts)")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse MoE MLP (else the dense SwiGLU): there are
        experts, ``(layer + 1) % moe_sparse_step == 0`` and ``layer`` is not in ``moe_dense_layers``."""
        return (self.num_experts > 0 and layer not in self.moe_dense_layers
                and (layer + 1) % self.moe_sparse_step == 0)

    @property
    def family_spec(self) -> Family:
        """The family declaration (:class:`~runtime.model.families.family.Family`)."""
        return family_of(self.family)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], *, vocab_size: int | None = None,
                         tied: bool = False, qkv_bias: bool | None = None) -> "ModelConfig":
        """Build from decoded GGUF metadata (key -> python value), llama.cpp key names.

        Args:
            fields: e.g. ``{"general.architecture": "qwen3", "qwen3.block_count": 36, ...}``.
            vocab_size: fallback when ``<arch>.vocab_size`` is absent (length of the token list).
            tied: the file has no ``output.weight`` (the LM head reuses ``token_embd``).
            qkv_bias: the file has ``attn_q.bias`` tensors (default: the family's declaration).
        Raises:
            UnsupportedModelError: an architecture no family reads, shared experts, a gating
                function other than softmax.
        """
        arch = fields.get("general.architecture")
        fam = family_for_gguf(arch)
        g = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
        hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
        scaling = None
        stype = g("rope.scaling.type")
        if stype not in (None, "none"):
            scaling = {"rope_type": stype, "factor": float(g("rope.scaling.factor", 1.0))}
            if g("rope.scaling.original_context_length") is not None:
                scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
        pieces = _gguf_pieces(fam, arch, g)
        if qkv_bias is not None:
            pieces["qkv_bias"] = qkv_bias
        return cls(
            **pieces, architecture=arch, vocab_size=int(g("vocab_size", vocab_size)), hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length", 0)), num_layers=int(g("block_count")),
            num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
            head_dim=int(g("attention.key_length", hidden // heads)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
            tie_word_embeddings=tied,
            max_position_embeddings=int(g("context_length", 2048)),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"))

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF ``config.json``.

        A family with a ``context_window_field`` (Mistral's / Mixtral's ``sliding_window``) has its
        context capped at the window, where sliding-window attention equals full attention.

        Raises:
            UnsupportedModelError: an architecture no family declares, or a config field the family
                refuses (the message names the field and the supported values).
        """
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        fam = family_for_hf(cfg)
        pieces = family_fields(fam, cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        if isinstance(cfg.get("rope_parameters"), Mapping):  # transformers 5 layout
            params = dict(cfg["rope_parameters"])
            theta = params.pop("rope_theta", theta)
            scaling = params if rope_type(params) != "default" else scaling
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get(fam.context_window_field) if fam.context_window_field else None
        if window:
            max_pos = min(max_pos, int(window))
        return cls(
            **pieces, architecture=archs[0], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` dict (``LlamaForCausalLM``), e.g. to export weights.

        Raises:
            UnsupportedModelError: the config is not of the ``llama`` family.
        """
        if self.family != "llama":
            raise UnsupportedModelError(f"to_hf_config exports the llama family only, not {self.family}")
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "attention_bias": self.qkv_bias, "torch_dtype": "float32"}


def _gguf_pieces(fam: Family, arch: str, g) -> dict[str, Any]:
    """The piece fields of a GGUF file of family ``fam`` (``g(key)`` reads ``<arch>.<key>``).

    Raises:
        UnsupportedModelError: shared experts or a non-softmax gating function.
    """
    p = fam.pieces
    out: dict[str, Any] = {"family": fam.name, "qk_norm": p.qk_norm,
                           "qkv_bias": p.qkv_bias if isinstance(p.qkv_bias, bool) else p.qkv_bias.default}
    if p.mlp == "moe":
        if int(g("expert_shared_count", 0) or 0):
            raise UnsupportedModelError(f"GGUF field '{arch}.expert_shared_count': shared experts "
                                        "are not supported (supported values: [0])")
        if int(g("expert_gating_func", 1) or 1) != 1:
            raise UnsupportedModelError(f"GGUF field '{arch}.expert_gating_func': only softmax "
                                        "gating is supported (supported values: [1])")
        norm = g("expert_weights_norm")
        out.update(num_experts=int(g("expert_count")), experts_per_token=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")),
                   moe_renormalize=bool(fam.moe.gguf_renormalize_default if norm is None else norm))
    return out
