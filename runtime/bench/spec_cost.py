"""``python -m runtime.bench.spec_cost``: the cost of a speculative verify step on one GPU, so the
speedup can be read for any acceptance rate.

A model of ``--shape`` (random benchmark weights, :mod:`runtime.bench.gpu_models`; ``--layers``
keeps the first N decoder layers, with the final norm and LM head) is run as a PP=1 stage on the
fast path. Per batch size ``rows`` at ``--context`` cached tokens per row it times, by CUDA
events over graph replays (median of ``--iters``):

* ``decode_ms``: a plain decode step (decode CUDA graph, greedy pick of each row's token);
* ``verify_ms[K][a]``: a verify step of ``1 + K`` tokens per row (verify CUDA graph, logits at
  every position, greedy pick at each, the batched acceptance rule of
  :func:`runtime.sampling.speculative_device.accept_rows`) with drafts forced so that a fraction ``a``
  of them (a prefix of ``round(a K)``) is accepted, ``a`` in 0, 0.5, 1;
* the n-gram proposer's cost per step over the rows' histories
  (:func:`runtime.sampling.speculative_device.propose_ngram_rows`).

Derived: ``speedup[K][a] = (1 + round(a K)) * decode_ms / verify_ms``, the decode tokens/s ratio
of speculation on vs off when every row accepts that many drafts per step. JSON to ``--out``.

    python -m runtime.bench.spec_cost --shape llama-3-8b --rows 1,8,32 --spec-list 2,4
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import numpy as np
import torch

from runtime.bench.gpu_models import model_config, random_stage
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.sampling.speculative_device import accept_rows, propose_ngram_rows
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.verify_graphs import VerifyGraphs

BLOCK = 16
ACCEPT = (0.0, 0.5, 1.0)


def _time(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` (3 warm-up calls)."""
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return float(np.median(times))


def measure(shape: str, layers: int | None, rows: list[int], ks: list[int], context: int,
            iters: int, dev) -> dict:
    cfg = model_config(shape)
    n_layers = cfg.num_layers if layers is None else min(layers, cfg.num_layers)
    stage = random_stage(shape, (0, n_layers), dev)
    if n_layers < cfg.num_layers:   # keep the final norm and LM head: a one-stage model
        stage.is_last = True
        stage.norm = torch.ones(cfg.hidden_size, device=dev, dtype=stage.embed.dtype)
        stage.lm_head = stage.embed if cfg.tie_word_embeddings else torch.randn(
            cfg.vocab_size, cfg.hidden_size, device=dev, dtype=stage.embed.dtype) * 0.02
    max_len = context + max(ks) + 2 * BLOCK
    per_row = -(-max_len // BLOCK)
    model = PagedStage(stage, max(rows) * per_row + 8, max_len)
    dgraphs = DecodeGraphs(model, max(rows), per_row, max_len)
    dgraphs.capture(progress=False)
    table = np.arange(max(rows) * per_row, dtype=np.int32).reshape(max(rows), per_row)
    hist = torch.randint(100, 1000, (max(rows), max_len), device=dev)
    res = {"shape": shape, "layers": n_layers, "context": context, "rows": {}}
    for r in rows:
        slots = np.arange(r)
        meta = PagedMeta.build(table[:r], [context] * r, [1] * r, BLOCK, dev, cfg.num_kv_heads)
        ids = torch.randint(100, 1000, (r,), device=dev)
        entry = {"decode_ms": _time(lambda: dgraphs.run(meta, input_ids=ids).argmax(-1), iters),
                 "verify_ms": {}, "speedup": {}, "proposer_ms": {}}
        for k in ks:
            vg = VerifyGraphs(model, max(rows), per_row, max_len, k)
            vg.buckets = [b for b in vg.buckets if b >= r][:1]
            vg.capture(progress=False)
            q = np.full(r, k + 1)
            vin = vg.inputs(slots, np.full(r, context), q, np.ones(r, bool), table, BLOCK)
            vids = torch.randint(100, 1000, (r * (k + 1),), device=dev)
            nd = torch.full((r,), k, device=dev)
            sampled = vg.run(vin, input_ids=vids).argmax(-1).view(r, k + 1)
            entry["verify_ms"][k], entry["speedup"][k] = {}, {}
            for a in ACCEPT:
                m = int(round(a * k))
                drafts = sampled[:, :k].clone()
                drafts[:, m:] += 1                       # positions m.. are rejected

                def step():
                    s = vg.run(vin, input_ids=vids).argmax(-1).view(r, k + 1)
                    return accept_rows(s, drafts, nd)
                ns, _ = step()
                assert int(ns.min()) == m + 1, (int(ns.min()), m)
                t = _time(step, iters)
                entry["verify_ms"][k][a] = t
                entry["speedup"][k][a] = (1 + m) * entry["decode_ms"] / t
            lengths = torch.full((r,), context + 1, device=dev)
            sl = torch.arange(r, device=dev)
            entry["proposer_ms"][k] = _time(
                lambda: propose_ngram_rows(hist, sl, lengths, context + 1, 3, k), iters)
            del vg
            gc.collect()
        res["rows"][r] = entry
        print(json.dumps({r: entry}), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.spec_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--layers", type=int, default=None, help="first N layers only (default all)")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--spec-list", default="2,4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="bench-results/spec_cost.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    res = measure(args.shape, args.layers, [int(x) for x in args.rows.split(",")],
                  [int(x) for x in args.spec_list.split(",")], args.context, args.iters,
                  torch.device("cuda", 0))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
