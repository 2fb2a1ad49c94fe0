"""Tiny random-weight checkpoints of every model family, saved by transformers' own classes
(2-4 layers, hidden 64, MoE with 8 experts and 2 per token), with a tiny word-level tokenizer
(so the engine can serve them), transformers' greedy reference on them, and a GGUF writer.

Biases and norm weights are drawn away from their initial zeros / ones so that every piece (QKV
bias, q/k norm) changes the output.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = dict(num_experts_per_tok=2)


def family_classes(family: str):
    """(config class, model class, extra config fields) of ``family`` in transformers."""
    import transformers as tf
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                      dict(MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(MOE, num_local_experts=8)),
    }[family]


def build_family_model(family: str, folder: Path, layers: int = 3, seed: int = 0, **overrides):
    """Save a random ``family`` model (fp32) and the default tokenizer into ``folder``; returns
    the transformers model (eval mode)."""
    cfg_cls, model_cls, extra = family_classes(family)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **extra, "num_hidden_layers": layers, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over ``VOCAB`` tokens ``t0 .. t{VOCAB-1}`` (``t1`` is EOS) as
    ``tokenizer.json`` + ``tokenizer_config.json``: enough for the engine to detokenize."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text('{"eos_token": "t1"}')


def generate_reference(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[int, ...]]:
    """transformers ``generate`` greedy (EOS ignored, all-ones mask), one prompt at a time."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0, eos_token_id=None)
            out.append(tuple(gen[0, len(p):].tolist()))
    return out


def write_gguf(folder: Path, path: Path, arch: str) -> None:
    """Write the HF ``folder``'s tensors (F32) and config as a GGUF file of architecture ``arch``
    with gguf-py: tensor names from gguf-py's own HF -> GGUF name map (``get_tensor_name_map``,
    the converter's), experts stacked ``[E, out, in]`` as llama.cpp stores them."""
    import gguf
    import numpy as np

    from runtime.model.hf_loader import HFCheckpoint
    from runtime.model.tensor_names import stage_tensor_names
    ckpt = HFCheckpoint(Path(folder))
    cfg = ckpt.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name in stage_tensor_names(cfg, (0, cfg.num_layers)):
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if not gname.endswith((".weight", ".bias")):
            gname += ".weight"
        w.add_tensor(gname, np.ascontiguousarray(ckpt.read(name).numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
