"""Independent reference: transformers loading the same GGUF (test-only dependency).

Greedy continuations are computed in fp32 with an explicit all-ones attention mask: SmolLM2's EOS
``<|im_end|>`` (id 2) appears inside chat prompts and ``generate`` would otherwise infer a mask
that hides those tokens (docs/design.md §8).
"""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def _gguf_parsed_once():
    """Memoize two pure functions of the ``gguf`` package while transformers imports a GGUF file.

    transformers parses the file's metadata once per ``load_gguf_checkpoint`` call (config, weights,
    tokenizer: three ``GGUFReader`` of the same path) and rebuilds gguf's tensor-name table for
    every submodule of the model (~400 ``get_tensor_name_map`` calls for SmolLM2); both results
    depend only on their arguments and are only read. Memoized, the reference loads in about half
    the time (pure-Python parsing dominated it); the weights and their dequantization are
    transformers' and gguf's own, unchanged.
    """
    import gguf
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(saved[0])
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread inside the block, restoring the previous count after.

    The reference decodes one token per forward (tiny GEMVs): with the default two threads on a
    2-core machine whose other processes (an engine's ranks, other tests) are busy, OpenMP's
    spinning made each step ~3-4x slower than one thread (measured in tests/helpers, 16 steps of
    a 30-token prompt: 13.8-19.1 s on 2 threads vs 3.3-5.3 s on 1, alternated). The ranks
    themselves compute on one thread, so this is also the configuration they run.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def hf_model():
    """(model, tokenizer) from transformers, fp32, eval mode; loaded once per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.model.registry import default_model_path
    path = default_model_path()
    with _gguf_parsed_once():
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
    with torch.no_grad(), one_thread():
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
    with torch.no_grad(), one_thread():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None)
    return tuple(out[0, len(prompt_ids):].tolist())


def sample_from_logits(logits, temperature: float, top_p: float, top_k: int, u: float) -> int:
    """The sampling rule of ``runtime.sampling.sampler`` restated in numpy (fp64), for one row.

    Temperature 0: argmax. Otherwise ``z = logits / temperature``; with a cut (top_k > 0 or
    top_p < 1) the candidates are the tokens in decreasing ``z`` order, the first ``top_k`` of
    them when ``top_k > 0``, with probabilities normalised over those candidates (top-k) or the
    whole vocabulary (top-p only); a candidate stays iff the mass of the candidates before it is
    < ``top_p``. Without a cut the candidates are the vocabulary in id order. The token drawn is
    the first candidate whose cumulative mass exceeds ``u`` times the kept mass.
    """
    import numpy as np
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return int(x.argmax())
    z = x / np.float64(np.float32(temperature))
    if top_k > 0 or top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        if top_k > 0:
            order = order[:top_k]
        norm = z[order] if top_k > 0 else z
        lse = norm.max() + np.log(np.exp(norm - norm.max()).sum())
        p = np.exp(z[order] - lse)
        p = np.where(np.cumsum(p) - p < top_p, p, 0.0)
    else:
        order = np.arange(len(z))
        p = np.exp(z - z.max())
    cdf = np.cumsum(p)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(order[min(j, len(order) - 1)])


@functools.lru_cache(maxsize=64)
def seeded_reference(prompt_ids: tuple[int, ...], max_new_tokens: int, temperature: float,
                     top_p: float, top_k: int, seed: int) -> tuple[int, ...]:
    """Seeded sampled continuation (EOS ignored): transformers logits (fp32) and
    :func:`sample_from_logits` with the uniform ``runtime.sampling.batch.seeded_uniform(seed, i)`` for
    the i-th new token (that hash is the documented contract, not the sampling itself)."""
    from transformers import DynamicCache

    from runtime.sampling.batch import seeded_uniform
    model, _ = hf_model()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    cache, out = DynamicCache(), []
    with torch.no_grad(), one_thread():
        for i in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=None, past_key_values=cache,
                           use_cache=True).logits[0, -1].float().numpy()
            nxt = sample_from_logits(logits, temperature, top_p, top_k, seeded_uniform(seed, i))
            out.append(nxt)
            ids = torch.tensor([[nxt]], dtype=torch.long)
    return tuple(out)
