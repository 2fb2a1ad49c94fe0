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
    """Greedy continuation (EOS ignored) of ``prompt_ids``: ``max_new_tokens`` token ids."""
    model, _ = hf_model()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    return tuple(out[0, len(prompt_ids):].tolist())
