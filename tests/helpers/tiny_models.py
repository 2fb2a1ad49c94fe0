"""A random 2-layer Llama (hidden 64) as an HF folder with a word-level tokenizer (``t0`` ..
``t{vocab-1}``, bos ``t1``, eos ``t2``) and a small chat template: a model folder the engine serves
in seconds, with transformers' own model as the reference.

:func:`make_tiny_llama` builds it with transformers; :func:`write_tiny_llama` writes one with torch
and safetensors only (no transformers import), so a server can start on it while
:func:`load_reference` loads transformers' model of the same folder."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

#: messages as ``t3 <content> t4``, then ``t5`` for the assistant; ``enable_thinking: false`` adds ``t6``
TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
            "{% if add_generation_prompt %}t5{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %} t6{% endif %}")


def make_tiny_llama(path, vocab: int = 256, max_model_len: int = 64):
    """Save the model at ``path``; returns the transformers model (fp32, eval). The LM head is
    scaled up so distributions are peaky (wide greedy margins, logprobs far from uniform)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_model_len, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(str(path))
    _write_tokenizer(Path(path), vocab)
    return model


def _write_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t1", "eos_token": "t2", "chat_template": TEMPLATE}))


def write_tiny_llama(path, vocab: int = 256, max_model_len: int = 64) -> None:
    """The same architecture as :func:`make_tiny_llama` (other random values), written with torch
    and safetensors: ``config.json`` (``ModelConfig.to_hf_config``), ``model.safetensors``, the
    tokenizer. Linear weights ~ N(0, 0.02), norms 1, the LM head scaled by 40."""
    from safetensors.torch import save_file

    from runtime.model.config import ModelConfig
    from runtime.model.tensor_names import LM_HEAD, expected_shape, stage_tensor_names
    path = Path(path)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-6, max_position_embeddings=max_model_len)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in stage_tensor_names(cfg, (0, cfg.num_layers)):
        shape = expected_shape(cfg, name)
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=g) * (0.02 * (40.0 if name == LM_HEAD else 1.0))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    _write_tokenizer(path, vocab)


@functools.lru_cache(maxsize=4)
def load_reference(path: str):
    """transformers' ``AutoModelForCausalLM`` of the folder ``path`` (fp32, eval), once per path."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` fp32 log-softmax of transformers' logits at each position."""
    with torch.no_grad():
        p = next(model.parameters())
        logits = model(torch.tensor([ids], device=p.device)).logits[0].float()
    return logits.log_softmax(-1).cpu()
