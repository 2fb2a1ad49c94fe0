"""transformers baselines on the same GPU and weights: ``generate`` with the default (dynamic)
cache and with ``cache_implementation="static"``, and a prefill forward, for the GPU benchmark."""

from __future__ import annotations

import time

import torch


def generate_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int, static: bool,
                          seed: int = 0) -> float:
    """Greedy ``generate`` of ``new_tokens`` per row (EOS ignored via ``min_new_tokens``) on random
    prompts; output tokens per second of the second call (the first warms up / compiles)."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 1, (batch, prompt_len), generator=g,
                        device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return batch * (out.shape[1] - prompt_len) / wall


def prefill_tokens_per_s(model, n: int, prompt_len: int) -> float:
    """One forward over ``n`` prompts of ``prompt_len`` tokens (logits of the last token only,
    like ppstate); prompt tokens per second, second call."""
    ids = torch.randint(100, model.config.vocab_size - 1, (n, prompt_len), device=model.device)
    with torch.inference_mode():
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = model.model(input_ids=ids).last_hidden_state[:, -1]
            model.lm_head(h)
            torch.cuda.synchronize()
    return n * prompt_len / (time.perf_counter() - t0)


def greedy_ids(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of ``prompt [P]`` (default cache): ``(ids [new_tokens], scores
    [new_tokens, V] fp32)``; callers judge a differing id by its score margin (near-ties)."""
    with torch.inference_mode():
        out = model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt[None]), output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[0, prompt.shape[0]:], torch.stack(out.scores, 0)[:, 0].float()
