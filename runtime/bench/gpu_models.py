"""Random-weight models for the GPU benchmark: the SmolLM2-135M, Llama-3-8B, Qwen3-8B and
Qwen3-30B-A3B (MoE: 128 experts, 8 per token) shapes. ``NAME@N`` is shape NAME cut to its first N
layers (e.g. ``qwen3-30b-a3b@24``), for runs that must fit a time or memory budget.

The real GGUF (93 MB) cannot travel to the GPU machine (64 MiB per call), so the benchmark makes
its weights there: every tensor is drawn from its own generator seeded by its name, so each PP rank
draws exactly its own layers and all ranks agree with the PP=1 model and with the transformers
model built from the same tensors. Scale 0.02 (HF's ``initializer_range``); norms are ones.
Shapes from the models' published ``config.json`` files.
"""

from __future__ import annotations

import zlib

import torch

from runtime.model.config import ModelConfig
from runtime.model.stage import StageModel
from runtime.model.tensor_names import expected_shape, stage_tensor_names

SHAPES: dict[str, dict] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "max_position_embeddings": 8192},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 40960},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 40960},
    "tiny-qwen3-moe": {  # for tests: the MoE family, small
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 1024},
    "tiny": {  # for tests: same family, CPU-sized
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 1024},
}


def hf_fields(shape: str) -> dict:
    """The ``config.json`` fields of ``shape`` (a key of :data:`SHAPES`, optionally ``@N`` layers).

    Raises:
        KeyError: unknown shape; ValueError: a layer count outside ``[1, num_hidden_layers]``.
    """
    name, _, layers = shape.partition("@")
    fields = dict(SHAPES[name])
    if layers:
        if not 1 <= int(layers) <= fields["num_hidden_layers"]:
            raise ValueError(f"{shape}: layers must be in [1, {fields['num_hidden_layers']}]")
        fields["num_hidden_layers"] = int(layers)
    return fields


def model_config(shape: str) -> ModelConfig:
    """The :class:`ModelConfig` of a named shape (see :func:`hf_fields`)."""
    return ModelConfig.from_hf_config(hf_fields(shape))


def random_tensor(cfg: ModelConfig, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The benchmark's tensor ``name``: ones for norms, else N(0, 0.02^2), seeded by the name."""
    shape = expected_shape(cfg, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)


def random_stage(shape: str, layer_range: tuple[int, int] | None, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> StageModel:
    """A :class:`StageModel` of ``layer_range`` (default: all layers) with the benchmark weights.
    Its paged cache starts with one block (``PagedStage(num_blocks=...)`` sizes it)."""
    cfg = model_config(shape)
    rng = layer_range or (0, cfg.num_layers)
    names = stage_tensor_names(cfg, rng)
    weights = {n: random_tensor(cfg, n, device, dtype) for n in names}
    return StageModel(cfg, rng, weights, max_num_reqs=1, max_model_len=16, dtype=dtype,
                      device=device, batch_invariant=False, block_size=block_size,
                      num_blocks=1).eval()


def hf_model(shape: str, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The transformers model of ``shape``'s family (``AutoModelForCausalLM``, sdpa) with the same
    tensors as :func:`random_stage`; stacked expert tensors are loaded into transformers' fused
    ``mlp.experts.gate_up_proj [E, 2 I, H]`` / ``down_proj [E, H, I]``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = model_config(shape)
    fields = {k: v for k, v in hf_fields(shape).items() if k not in ("architectures", "model_type")}
    hf_cfg = AutoConfig.for_model(hf_fields(shape)["model_type"], **fields)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in stage_tensor_names(cfg, (0, cfg.num_layers)):
            t = random_tensor(cfg, n, device, dtype)
            if n.endswith("mlp.experts.gate_proj") or n.endswith("mlp.experts.up_proj"):
                fused = params[n.rsplit(".", 1)[0] + ".gate_up_proj"]
                half = fused.shape[1] // 2
                (fused[:, :half] if n.endswith("gate_proj") else fused[:, half:]).copy_(t)
            elif n in params:
                params[n].copy_(t)
            del t
    return model.eval()   # a tied lm_head follows the embedding


def make_folder(shape: str, path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Save the benchmark model of ``shape`` as an HF folder at ``path`` (safetensors +
    config.json) with a word-level tokenizer over its vocabulary (``t0`` .. ``tN``; bos ``t1``,
    eos ``t2``): what the engine needs to serve it by token ids. Returns the transformers model."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    path = Path(path)
    hf = hf_model(shape, device, dtype)
    hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf.config.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    return hf
