"""A random 2-layer Llama (hidden 64) saved by transformers with a word-level tokenizer
(``t0`` .. ``t{vocab-1}``, bos ``t1``, eos ``t2``) and a small chat template: a model folder the
engine serves in seconds, with transformers' own model as the reference."""

from __future__ import annotations

import json

import torch

#: messages as ``t3 <content> t4``, then ``t5`` for the assistant; ``enable_thinking: false`` adds ``t6``
TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
            "{% if add_generation_prompt %}t5{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %} t6{% endif %}")


def make_tiny_llama(path, vocab: int = 256, max_model_len: int = 64):
    """Save the model at ``path``; returns the transformers model (fp32, eval). The LM head is
    scaled up so distributions are peaky (wide greedy margins, logprobs far from uniform)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_model_len, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t1", "eos_token": "t2", "chat_template": TEMPLATE}))
    return model


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` fp32 log-softmax of transformers' logits at each position."""
    with torch.no_grad():
        p = next(model.parameters())
        logits = model(torch.tensor([ids], device=p.device)).logits[0].float()
    return logits.log_softmax(-1).cpu()
