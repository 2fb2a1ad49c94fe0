"""A tiny random-weight Llama with the embedded model's real tokenizer and chat template.

Two layers, hidden 64, SmolLM2's 49,152-token vocabulary: fast to serve on the CPU, while the
grammar engine works on the real vocabulary (byte-level BPE pieces, ``<|im_end|>`` as EOS).
Built with transformers' own classes; seeded, so every build is the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tiny_chat_model(path: Path, seed: int = 0) -> Path:
    """Write the HF folder (safetensors, config.json, tokenizer.json, tokenizer_config.json)
    at ``path`` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.model.registry import resolve_model_path
    from runtime.model.tokenizer import load_tokenizer
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(resolve_model_path("default"))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.id_to_token(tok.bos_token_id), "eos_token": tok.id_to_token(tok.eos_token_id),
        "chat_template": tok.chat_template}))
    return path
