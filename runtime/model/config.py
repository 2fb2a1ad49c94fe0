"""Model architecture configuration, read from GGUF metadata (``llama.*`` keys) or HF ``config.json``."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from runtime.model.errors import UnsupportedModelError

#: HF ``architectures`` / GGUF ``general.architecture`` values this runtime can run (Llama family).
SUPPORTED_HF_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM"}
SUPPORTED_GGUF_ARCHS = {"llama"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


class ModelConfig(BaseModel):
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        architecture: ``llama`` (GGUF) or the HF class name, e.g. ``LlamaForCausalLM``.
        head_dim: per-head width; ``hidden_size // num_heads`` unless given.
        rope_scaling: None, ``{"rope_type": "linear", "factor": f}`` or the Llama 3 form
            ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`` (HF conventions).
    Raises:
        UnsupportedModelError: (at validation) unknown rope scaling type or inconsistent head sizes.
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

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        rtype = rope_type(self.rope_scaling)
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {rtype!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})")
        return self

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], *, vocab_size: int | None = None,
                         tied: bool = False) -> "ModelConfig":
        """Build from decoded GGUF metadata (key -> python value), llama.cpp key names.

        Args:
            fields: e.g. ``{"general.architecture": "llama", "llama.block_count": 30, ...}``.
            vocab_size: fallback when ``llama.vocab_size`` is absent (length of the token list).
            tied: the file has no ``output.weight`` (the LM head reuses ``token_embd``).
        Raises:
            UnsupportedModelError: architecture other than ``llama``.
        """
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_GGUF_ARCHS)})")
        g = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
        hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
        scaling = None
        stype = g("rope.scaling.type")
        if stype not in (None, "none"):
            scaling = {"rope_type": stype, "factor": float(g("rope.scaling.factor", 1.0))}
        return cls(
            architecture=arch, vocab_size=int(g("vocab_size", vocab_size)), hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
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

        Raises:
            UnsupportedModelError: architecture outside the Llama family, or attention / MLP biases.
        """
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if archs[0] not in SUPPORTED_HF_ARCHS and cfg.get("model_type") not in ("llama", "mistral"):
            raise UnsupportedModelError(
                f"architecture {archs[0]!r} is not supported (supported: {sorted(SUPPORTED_HF_ARCHS)})")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModelError("attention_bias / mlp_bias are not supported")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        if isinstance(cfg.get("rope_parameters"), Mapping):  # transformers 5 layout
            params = dict(cfg["rope_parameters"])
            theta = params.pop("rope_theta", theta)
            scaling = params if rope_type(params) != "default" else scaling
        return cls(
            architecture=archs[0], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` dict (``LlamaForCausalLM``), e.g. to export weights."""
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
            "torch_dtype": "float32"}


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The rope scaling kind of an HF-style ``rope_scaling`` dict (``default`` when None)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")
