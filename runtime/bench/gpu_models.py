"""Random-weight models for the GPU benchmark: the SmolLM2-135M and Llama-3-8B shapes.

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
    "tiny": {  # for tests: same family, CPU-sized
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 1024},
}


def model_config(shape: str) -> ModelConfig:
    """The :class:`ModelConfig` of a named shape (keys of :data:`SHAPES`)."""
    return ModelConfig.from_hf_config(SHAPES[shape])


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
    """transformers ``LlamaForCausalLM`` with the same tensors as :func:`random_stage` (sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = model_config(shape)
    hf_cfg = LlamaConfig(**{k: v for k, v in SHAPES[shape].items() if k not in ("architectures",)})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg)
    names = stage_tensor_names(cfg, (0, cfg.num_layers))
    state = {n: random_tensor(cfg, n, device, dtype) for n in names}
    model.load_state_dict(state, strict=False)   # tied lm_head follows the embedding
    del state
    return model.to(dtype).eval()


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
