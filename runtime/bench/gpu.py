"""``python -m runtime.bench gpu``: the GPU fast path against transformers, and PP=2 over NCCL.

For each model shape (random bf16 weights, see :mod:`runtime.bench.gpu_models`; Llama, Qwen3 and
the Qwen3-MoE shape ``qwen3-30b-a3b``, ``NAME@N`` for its first N layers):

* PP=1 decode throughput at each ``--batches`` size: ``--prompt-len`` random prompts, greedy,
  ``--new-tokens`` output tokens each, EOS ignored; output tokens/s over prefill + decode, for
  ppstate's fast path (paged Triton attention + CUDA graphs; and eager, ``--eager-batches``) and
  transformers ``generate`` (default cache; static cache at ``--static-batches``), same GPU, same
  run. Also the decode step time, the host time spent issuing a step, and the step's roofline
  (weights read / 4.3 TB/s, MoE: only the experts touched; :mod:`runtime.bench.roofline`).
* Prefill tokens/s (``--prefill-prompts`` x ``--prefill-len``): ppstate vs a transformers forward.
* PP=2 (two GPUs, NCCL, ``--pp 2``): decode-heavy (``--pp-batch`` rows, ``--pp-prompt-len``,
  ``--pp-new-tokens``) overlapped vs sync, against PP=1 on one GPU; long-prompt TTFT
  (``--ttft-prompts`` x ``--ttft-len``) overlapped vs sync.

Writes ``benchmarks/results/gpu-DATE.json`` (keys ``pp1``, ``pp2``, ``validate_mirrors_cost``, ...)
and prints a Markdown table (``python -m runtime.bench gpu --table FILE`` re-prints it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runtime.bench.gpu_decode import GreedyLoop, make_lane
from runtime.bench.gpu_models import hf_model, model_config, random_stage
from runtime.bench.gpu_table import markdown
from runtime.bench.roofline import roofline_step_s
from runtime.model.paged_stage import PagedStage
from runtime.worker.cuda_graphs import DecodeGraphs

BLOCK = 16


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def pp1_run(loop: GreedyLoop, batch: int, plen: int, new: int, vocab: int, seed: int = 0) -> dict:
    """Prefill + ``new - 1`` decode steps of ``batch`` rows; output tokens/s and step figures."""
    dev = loop.model.kv_cache.device
    lane = make_lane(batch, -(-(plen + new) // BLOCK), 0, dev, seed=seed)
    prompts = np.random.default_rng(seed).integers(100, vocab - 1, (batch, plen))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop.prefill(lane, prompts)
    torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t0
    d = loop.decode(lane, new - 1)
    wall = t_prefill + d["wall_s"]
    return {"tokens_per_s": batch * new / wall, "decode_tokens_per_s": batch * (new - 1) / d["wall_s"],
            "step_ms": 1e3 * d["wall_s"] / (new - 1), "host_issue_ms": 1e3 * d["issue_s"] / (new - 1),
            "prefill_s": t_prefill}


def pp1_decode_heavy(loop: GreedyLoop, args, vocab: int) -> dict[int, dict]:
    """PP=1 reference of the PP=2 decode-heavy workload at each ``--pp-batches`` concurrency."""
    return {b: pp1_run(loop, b, args.pp_prompt_len, args.pp_new_tokens, vocab)
            for b in args.pp_batches}


def validation_run(loop: GreedyLoop, batch: int, plen: int, new: int, vocab: int) -> dict:
    """Decode tokens/s with the per-slot state driven every step and mirror validation off,
    synchronous (host sync each step) and async (pinned snapshot, compared a step later)."""
    dev = loop.model.kv_cache.device
    res = {"batch_size": batch}
    for mode in ("off", "sync", "async", "off"):   # "off" twice: the spread of the figure
        lane = make_lane(batch, -(-(plen + new) // BLOCK), 0, dev, seed=9)
        prompts = np.random.default_rng(9).integers(100, vocab - 1, (batch, plen))
        loop.prefill(lane, prompts)
        d = loop.decode(lane, new - 1, validate=mode)
        tps = batch * (new - 1) / d["wall_s"]
        res[f"{mode}_tokens_per_s"] = max(tps, res.get(f"{mode}_tokens_per_s", 0.0))
    res["async_cost"] = 1 - res["async_tokens_per_s"] / res["off_tokens_per_s"]
    res["sync_cost"] = 1 - res["sync_tokens_per_s"] / res["off_tokens_per_s"]
    return res


def bench_shape(shape: str, args, dev: torch.device) -> dict:
    """Every PP=1 figure of one shape (see module doc)."""
    cfg = model_config(shape)
    stage = random_stage(shape, None, dev)
    max_len = max(args.prompt_len + args.new_tokens, args.pp_prompt_len + args.pp_new_tokens,
                  args.prefill_len + 1) + BLOCK
    mb = -(-max_len // BLOCK)
    max_rows = max(args.batches + args.pp_batches)
    per_row = lambda tokens: -(-tokens // BLOCK)  # noqa: E731
    num_blocks = max(max(args.batches) * per_row(args.prompt_len + args.new_tokens),
                     max(args.pp_batches) * per_row(args.pp_prompt_len + args.pp_new_tokens),
                     args.prefill_prompts * mb) + 8
    model = PagedStage(stage, num_blocks, max_len)
    graphs = DecodeGraphs(model, max_rows, mb, max_len)
    rep = graphs.capture(progress=True)
    print(f"[{shape}] captured {len(rep.buckets)} CUDA graphs in {rep.seconds:.1f} s, "
          f"{rep.bytes / 2**20:.0f} MiB", flush=True)
    out = {"capture": {"buckets": rep.buckets, "seconds": rep.seconds, "bytes": rep.bytes},
           "pp1": [], "eager": [], "prefill": {}}
    fast, eager = GreedyLoop(model, graphs), GreedyLoop(model, None)
    hf = hf_model(shape, dev) if not (args.no_hf or args.pp2_only) else None
    pp1_run(fast, 4, args.prompt_len, 8, cfg.vocab_size)    # warm-up: Triton compiles, allocator
    pp1_run(eager, 4, args.prompt_len, 8, cfg.vocab_size)
    if args.pp2_only:   # only the PP=1 reference of the PP=2 workload
        out["pp1_decode_heavy"] = pp1_decode_heavy(fast, args, cfg.vocab_size)
        del hf, fast, eager, graphs, model, stage
        torch.cuda.empty_cache()
        return out
    static_batches = args.static_batches if shape in args.static_shapes.split(",") else []
    for b in args.batches:
        r = pp1_run(fast, b, args.prompt_len, args.new_tokens, cfg.vocab_size)
        row = {"model": shape, "batch_size": b, **r,
               "roofline_step_ms": 1e3 * roofline_step_s(cfg, b)}
        row["step_vs_roofline"] = row["step_ms"] / row["roofline_step_ms"]
        if b in args.eager_batches:
            e = pp1_run(eager, b, args.prompt_len, args.new_tokens, cfg.vocab_size)
            row["eager_tokens_per_s"] = e["tokens_per_s"]
            row["eager_step_ms"] = e["step_ms"]
        if hf is not None:
            from runtime.bench.gpu_hf import generate_tokens_per_s
            row["transformers_default_tokens_per_s"] = generate_tokens_per_s(
                hf, b, args.prompt_len, args.new_tokens, static=False)
            if b in static_batches:
                row["transformers_static_tokens_per_s"] = generate_tokens_per_s(
                    hf, b, args.prompt_len, args.new_tokens, static=True)
        print(json.dumps(row), flush=True)
        out["pp1"].append(row)
    # mirror validation: per-slot state + mirrors every step, validation off / sync / async
    out["validation"] = validation_run(fast, args.validate_batch, args.prompt_len, args.new_tokens,
                                       cfg.vocab_size)
    print(json.dumps({"validation": out["validation"]}), flush=True)
    # prefill
    lane = make_lane(args.prefill_prompts, mb, 0, dev, seed=5)
    prompts = np.random.default_rng(5).integers(100, cfg.vocab_size - 1,
                                                (args.prefill_prompts, args.prefill_len))
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fast.prefill(lane, prompts, chunk_tokens=args.prefill_chunk)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out["prefill"] = {"model": shape, "prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                      "tokens_per_s": args.prefill_prompts * args.prefill_len / wall,
                      "pp1_mean_ttft_s": None}
    if hf is not None:
        from runtime.bench.gpu_hf import prefill_tokens_per_s
        out["prefill"]["transformers_tokens_per_s"] = prefill_tokens_per_s(
            hf, args.prefill_prompts, args.prefill_len)
    print(json.dumps(out["prefill"]), flush=True)
    # PP=1 reference of the PP=2 decode-heavy workload, same GPU path
    if args.pp == 2:
        out["pp1_decode_heavy"] = pp1_decode_heavy(fast, args, cfg.vocab_size)
        print(json.dumps({"pp1_decode_heavy": out["pp1_decode_heavy"]}), flush=True)
    del hf, fast, eager, graphs, model, stage
    gc.collect()        # compiled static-cache models sit in reference cycles: free them now
    torch.cuda.empty_cache()
    return out


def bench_pp2(shape: str, args, pp1_tps: dict[int, float]) -> list[dict]:
    """Overlapped vs sync PP=2 rows of one shape (needs two GPUs): decode-heavy at each
    ``--pp-batches`` concurrency (``pp1_tps``: PP=1 tokens/s at that concurrency) and long-prompt
    TTFT at each ``--ttft-chunks`` chunk size (both modes with the same chunks)."""
    from runtime.bench.gpu_pp import run_pp2
    jobs = []
    for batch in args.pp_batches:
        for mode in ("sync", "overlapped"):
            jobs.append({"kind": "decode", "mode": mode, "batch": batch,
                         "plen": args.pp_prompt_len, "new": args.pp_new_tokens})
    for chunk in args.ttft_chunks:
        for mode in ("sync", "overlapped"):
            jobs.append({"kind": "ttft", "mode": mode, "n": args.ttft_prompts,
                         "plen": args.ttft_len, "chunk": chunk})
    got = run_pp2(shape, jobs)[1]
    res = {(j["kind"], j["mode"], j.get("batch", j.get("chunk"))): r
           for j, r in zip(jobs, got["results"])}
    rows = []
    for batch in args.pp_batches:
        o, s = res[("decode", "overlapped", batch)], res[("decode", "sync", batch)]
        rows.append({"model": shape, "workload": "decode-heavy", "batch_size": batch,
                     "overlapped_tokens_per_s": o["tokens_per_s"], "sync_tokens_per_s": s["tokens_per_s"],
                     "throughput_ratio": o["tokens_per_s"] / s["tokens_per_s"], "ttft_ratio": None,
                     "pp1_tokens_per_s": pp1_tps.get(batch)})
    for chunk in args.ttft_chunks:
        o, s = res[("ttft", "overlapped", chunk)], res[("ttft", "sync", chunk)]
        rows.append({"model": shape, "workload": "long-prompt", "chunk": chunk,
                     "overlapped_tokens_per_s": None, "sync_tokens_per_s": None,
                     "throughput_ratio": None, "ttft_ratio": s["mean_ttft_s"] / o["mean_ttft_s"],
                     "overlapped_mean_ttft_s": o["mean_ttft_s"], "sync_mean_ttft_s": s["mean_ttft_s"],
                     "pp1_tokens_per_s": None})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench gpu", description=__doc__)
    p.add_argument("--shapes", default="smollm2-135m,llama-3-8b")
    p.add_argument("--batches", type=_ints, default=[1, 32, 128, 256])
    p.add_argument("--eager-batches", type=_ints, default=[1, 128])
    p.add_argument("--static-batches", type=_ints, default=[32, 128, 256])
    p.add_argument("--static-shapes", default="smollm2-135m",
                   help="shapes for which transformers' static cache is measured (compiles per batch)")
    p.add_argument("--validate-batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=16384)
    p.add_argument("--pp", type=int, default=1, choices=[1, 2])
    p.add_argument("--pp-batches", type=_ints, default=[256],
                   help="decode-heavy concurrencies of the PP=2 rows (the first is the headline)")
    p.add_argument("--pp-prompt-len", type=int, default=128)
    p.add_argument("--pp-new-tokens", type=int, default=256)
    p.add_argument("--ttft-prompts", type=int, default=8)
    p.add_argument("--ttft-len", type=int, default=4096)
    p.add_argument("--ttft-chunks", type=_ints, default=[2048, 4096, 1024],
                   help="prefill chunk sizes of the long-prompt rows (the first is the headline; "
                   "2048 = vLLM's default token budget of its API server)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--pp2-only", action="store_true",
                   help="with --pp 2: only the PP=2 rows and their PP=1 reference")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu-DATE.json)")
    p.add_argument("--table", default=None, help="print the Markdown table of an existing JSON")
    p.add_argument("--make-folder", default=None, metavar="PATH",
                   help="only save the first --shapes model as an HF folder at PATH (random bf16 "
                   "weights, word-level tokenizer) for the engine benchmark, and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return 0
    if args.make_folder:
        from runtime.bench.gpu_models import make_folder
        make_folder(args.shapes.split(",")[0], args.make_folder,
                    torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"wrote {args.make_folder}")
        return 0
    if not torch.cuda.is_available():
        p.error("python -m runtime.bench gpu needs a CUDA device")
    if args.pp == 2 and torch.cuda.device_count() < 2:
        p.error("--pp 2 needs two CUDA devices (one per rank, NCCL)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", 0)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    res = {"date": date, "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
           "torch": torch.__version__, "command": "python -m runtime.bench gpu " + " ".join(
               sys.argv[2:] if argv is None else argv),
           "pp1": [], "pp2": [], "prefill": [], "capture": {}, "validate_mirrors_cost": None}
    out_path = Path(args.out or f"benchmarks/results/gpu-{date}.json")
    for shape in args.shapes.split(","):
        r = bench_shape(shape, args, dev)
        res["pp1"] += r["pp1"]
        res["capture"][shape] = r["capture"]
        if not args.pp2_only:
            res["prefill"].append(r["prefill"])
            res.setdefault("validation", {})[shape] = r["validation"]
            if res["validate_mirrors_cost"] is None:       # the first shape's (SmolLM2's) figure
                res["validate_mirrors_cost"] = r["validation"]["async_cost"]
        if args.pp == 2:
            res["pp2"] += bench_pp2(shape, args, {b: d["tokens_per_s"]
                                                  for b, d in r["pp1_decode_heavy"].items()})
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=2))
    print(markdown(res))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
