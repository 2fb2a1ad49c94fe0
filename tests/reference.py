"""Independent reference: transformers loading the same GGUF (test-only dependency).

Greedy continuations are computed in fp32 with an explicit all-ones attention mask: SmolLM2's EOS
``<|im_end|>`` (id 2) appears inside chat prompts and ``generate`` would otherwise infer a mask
that hides those tokens (DESIGN.md section 9).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def hf_model():
    """(model, tokenizer) from transformers, fp32, eval mode; loaded once per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.model.registry import default_model_path
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


@functools.lru_cache(maxsize=256)
def greedy_reference(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """Greedy continuation (EOS ignored) of ``prompt_ids``: ``max_new_tokens`` token ids.

    A plain loop over the transformers model's forward with its own KV cache (argmax of fp32
    logits); ``generate`` gives the same ids but was ~20x slower here (transformers 5.x on CPU).
    """
    from transformers import DynamicCache
    model, _ = hf_model()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    cache, out = DynamicCache(), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=None, past_key_values=cache,
                           use_cache=True).logits
            nxt = int(logits[0, -1].float().argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]], dtype=torch.long)
    return tuple(out)


def greedy_generate_reference(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """The same continuation through ``model.generate`` (explicit all-ones attention mask)."""
    model, _ = hf_model()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    return tuple(out[0, len(prompt_ids):].tolist())
