"""``python -m runtime.bench.structured --grammar-micro``: the last rank's grammar host time per
decode step, row-by-row (before) against batched (after), in one run.

Two :class:`~runtime.sampling.grammar_state.GrammarState` copies hold ``--rows`` matchers of the
benchmark's schema (``ROWS_SCHEMA``: every token constrained). Each step both are fed the same
tokens (a seeded random pick among the allowed ones of row ``i``, so rows drift apart in the
grammar as served rows do) and timed in turn (A B, then B A):

* **before**: ``fill_next_token_bitmask`` and the JSON control-byte mask row by row into a fresh
  bitmask, one ``accept_token`` per row (the path before batching).
* **after**: :meth:`GrammarState._fill` (one ``BatchGrammarMatcher`` call on ``threads`` threads,
  one vectorised mask) and :meth:`GrammarState.accept_batch`, for each ``--threads`` value.

Every step asserts that both bitmasks are equal. On CUDA the ``apply`` (copy of the bitmask to
the device and the masking kernel over ``[rows, V]`` logits, synchronised) is timed too.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

#: the schema of the engine benchmark (runtime.bench.structured imports it from here too)
ROWS_SCHEMA = {"type": "array", "minItems": 10_000, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]}},
    "required": ["id", "name", "ok", "level"]}}


def _state(cache, rows: int, threads: int):
    from runtime.sampling.grammar_state import GrammarState
    g = GrammarState(cache, rows, threads=threads)
    spec = {"kind": "json_schema", "value": json.dumps(ROWS_SCHEMA)}
    for s in range(rows):
        g.admit(s, spec, [])
    for s in range(rows):
        g.matcher(s)
    return g


def _pick(rng: np.random.Generator, row: torch.Tensor, vocab: int) -> int:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return int(rng.choice(np.flatnonzero(bits)))


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def _mean_ms(xs: list[float]) -> float:
    return round(statistics.fmean(xs) * 1e3, 3)


def run_micro(tokenizer, rows: int, steps: int, threads: list[int], device: str) -> dict:
    """Per-step grammar host time, before and after, over ``steps`` decode steps of ``rows``
    constrained rows; ``threads``: the batched variant's thread counts. Returns per-step medians
    in ms (``fill_mean_ms``: the mean fill, which the steps inside bounded strings dominate)."""
    from runtime.sampling.grammar import GrammarCompilerCache, tokenizer_info
    cache = GrammarCompilerCache(tokenizer_info(tokenizer), "micro")
    before = _state(cache, rows, 1)
    afters = {t: _state(cache, rows, t) for t in threads}
    vocab, words = before.vocab_size, before.words
    dev = torch.device(device)
    logits = torch.randn(rows, vocab, device=dev) if dev.type == "cuda" else None
    layout = [(s, s, []) for s in range(rows)]
    rng = np.random.default_rng(0)
    t_before: dict[str, list[float]] = {"fill": [], "accept": []}
    t_after = {t: {"fill": [], "accept": [], "apply": []} for t in threads}
    for step in range(steps):
        order = ["before", *threads] if step % 2 == 0 else [*threads, "before"]
        masks = {}
        for v in order:
            t0 = time.perf_counter()
            if v == "before":
                masks[v] = before._fill_rowwise(torch.full((rows, words), -1, dtype=torch.int32),
                                                layout)
                t_before["fill"].append(time.perf_counter() - t0)
            else:
                g = afters[v]
                f = g.start_fill(rows, layout)
                done = f.future.result()
                t_after[v]["fill"].append(time.perf_counter() - t0)
                masks[v] = done.clone()
                if logits is not None:
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    g.apply(logits, f)
                    torch.cuda.synchronize()
                    t_after[v]["apply"].append(time.perf_counter() - t1)
        for v in threads:
            if not torch.equal(masks[v], masks["before"]):
                raise AssertionError(f"step {step}: batched bitmask ({v} threads) differs")
        toks = [_pick(rng, masks["before"][i], vocab) for i in range(rows)]
        for v in order:
            t0 = time.perf_counter()
            if v == "before":
                for s in range(rows):
                    before.accept(s, [toks[s]])
                t_before["accept"].append(time.perf_counter() - t0)
            else:
                afters[v].accept_batch(list(range(rows)), toks)
                t_after[v]["accept"].append(time.perf_counter() - t0)
    out = {"rows": rows, "steps": steps, "vocab": vocab, "device": device,
           "before": {"fill_ms": _ms(t_before["fill"]), "accept_ms": _ms(t_before["accept"]),
                      "fill_mean_ms": _mean_ms(t_before["fill"])},
           "after": {}}
    out["before"]["total_ms"] = round(out["before"]["fill_ms"] + out["before"]["accept_ms"], 3)
    for t in threads:
        a = t_after[t]
        r = {"fill_ms": _ms(a["fill"]), "accept_ms": _ms(a["accept"]),
             "fill_mean_ms": _mean_ms(a["fill"])}
        if a["apply"]:
            r["apply_ms"] = _ms(a["apply"])
        r["total_ms"] = round(r["fill_ms"] + r["accept_ms"], 3)
        r["speedup"] = round(out["before"]["total_ms"] / r["total_ms"], 2)
        out["after"][str(t)] = r
    for g in [before, *afters.values()]:
        g.close()
    return out
