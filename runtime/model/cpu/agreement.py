"""How closely the CPU fast path follows the exact reference on the same tokens.

Both stages (whole model, one rank each) read the same token rows in one prefill step; the
logits of every position are compared (teacher forcing: the fast path is never fed its own
tokens, so one early difference does not compound): top-1 match rate, and the largest absolute
difference of the log-probability each path gives to the reference's top-1 token. Then both
decode greedily from the prompts and the common prefix of their tokens is counted.
"""

from __future__ import annotations

import dataclasses

import torch

from runtime.model.batch_meta import BatchMeta

#: held prompts of the quality check (tests, benchmarks); varied topics and forms
HELD_PROMPTS = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the "
    "city to the fall of Constantinople. Its institutions, laws and roads shaped Europe.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make glucose and oxygen. It takes place mainly in the leaves.",
    "Dear hiring manager, I am writing to apply for the position of data analyst at your company. "
    "I have three years of experience with SQL, Python and dashboards.",
    "Recipe for pancakes: mix two cups of flour, two eggs, a cup and a half of milk, a spoonful "
    "of sugar and a pinch of salt. Heat a pan with butter and pour a ladle of batter.",
    "User: What is the tallest mountain in the world and how high is it?\nAssistant: Mount "
    "Everest, on the border between Nepal and China, is the highest mountain above sea level.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz "
    "Aldrin walked on the surface while Michael Collins orbited above in the command module.",
)


def _meta(stage, lens: list[int], starts: list[int], all_positions: bool) -> BatchMeta:
    r = len(lens)
    meta = BatchMeta.build(torch.arange(r), torch.tensor(starts), torch.tensor(lens), "cpu",
                           stage.default_block_table, stage.block_size, attention_groups=True)
    if all_positions:
        meta = dataclasses.replace(meta, last_token=torch.arange(meta.num_tokens))
    return meta


def compare(ref, fast, rows: list[list[int]], new_tokens: int) -> dict:
    """Teacher-forced comparison over every position of ``rows`` (token id lists, one prefill
    step per stage), then ``new_tokens - 1`` greedy decode steps of each stage from its own KV
    cache (the first greedy token is the prefill's last-position argmax).

    Args:
        ref, fast: whole-model stages (``StageModel`` / ``CpuFastStage``) with at least
            ``len(rows)`` slots and room for the rows plus ``new_tokens``.
    Returns:
        ``{"positions", "top1_match", "max_abs_logprob_diff", "mean_abs_logprob_diff",
        "greedy_ref", "greedy_fast", "common_prefix"}`` (greedy tokens per row; common prefix
        length per row).
    """
    ids = torch.tensor([t for row in rows for t in row])
    lens = [len(r) for r in rows]
    last = torch.tensor(lens).cumsum(0) - 1
    lp = {}
    for key, st in (("ref", ref), ("fast", fast)):
        lp[key] = st(_meta(st, lens, [0] * len(rows), True), input_ids=ids).float().log_softmax(-1)
    top = lp["ref"].argmax(-1, keepdim=True)
    diff = (lp["ref"].gather(1, top) - lp["fast"].gather(1, top)).abs()
    out = {"positions": int(ids.numel()),
           "top1_match": float((lp["fast"].argmax(-1, keepdim=True) == top).float().mean()),
           "max_abs_logprob_diff": float(diff.max()),
           "mean_abs_logprob_diff": float(diff.mean())}
    for key, st in (("ref", ref), ("fast", fast)):
        first = lp[key].index_select(0, last).argmax(-1).tolist()
        out[f"greedy_{key}"] = decode_from(st, [[t] for t in first], lens, new_tokens)
    out["common_prefix"] = [common_prefix(a, b) for a, b in zip(out["greedy_ref"], out["greedy_fast"])]
    return out


def decode_from(stage, out: list[list[int]], lens: list[int], new_tokens: int) -> list[list[int]]:
    """Greedy decode steps (all rows each step) until each row of ``out`` has ``new_tokens``
    tokens; row r's cache holds its ``lens[r]`` prompt tokens and ``out[r][:-1]``."""
    while len(out[0]) < new_tokens:
        starts = [n + len(o) - 1 for n, o in zip(lens, out)]
        logits = stage(_meta(stage, [1] * len(out), starts, False),
                       input_ids=torch.tensor([o[-1] for o in out]))
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(int(t))
    return out


def greedy(stage, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each row (all rows in every step), ``new_tokens`` each."""
    lens = [len(r) for r in rows]
    logits = stage(_meta(stage, lens, [0] * len(rows), False),
                   input_ids=torch.tensor([t for r in rows for t in r]))
    return decode_from(stage, [[int(t)] for t in logits.argmax(-1)], lens, new_tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
