"""``python -m runtime.bench.gpu_stage``: what a PP=2 decode round can gain, measured on one GPU.

Overlapped PP splits a concurrency of ``B`` decode rows into two lanes of ``B / 2`` rows, and
each rank runs both lanes per round; sync mode runs one batch of ``B`` rows through the two ranks
in turn. With perfect overlap and free hidden-state transfers (docs/design.md, "Performance
model"), per ``B`` decoded tokens:

* sync round       = t0(B) + t1(B)
* overlapped round = max(2 t0(B/2), 2 t1(B/2))   (each rank computes both lanes)
* PP=1 step        = t_full(B)

where ``t0`` / ``t1`` are the decode-step times of the first / last half of the model (the last
half carries the final norm, the LM head and the argmax). The ratios of these are the ceilings
of ``throughput_ratio`` (overlapped / sync) and of overlapped / PP=1 at concurrency ``B``: the
overlap reaches 2.0 only where a step's cost is proportional to its rows. A step that streams
the stage's weights once (a floor of bytes / bandwidth whatever the rows) and attends over every
row's KV cache is not.

Each half is built like a PP rank builds it (random benchmark weights, :mod:`gpu_models`), its
decode steps captured as CUDA graphs (:class:`~runtime.worker.cuda_graphs.DecodeGraphs`), and
timed by replaying them with CUDA events at ``--context`` cached tokens per row (median of
``--iters`` replays). Writes ``benchmarks/results/gpu-stage-DATE.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

from runtime.bench.gpu_decode import make_lane
from runtime.bench.gpu_models import model_config, random_stage
from runtime.model.paged_stage import PagedStage
from runtime.worker.cuda_graphs import DecodeGraphs

BLOCK = 16


def step_ms(model: PagedStage, graphs: DecodeGraphs, rows: int, context: int, iters: int) -> float:
    """Median milliseconds of one decode step of ``rows`` rows with ``context`` cached tokens
    each (graph replay; KV contents are whatever the cache holds: the cost does not depend on
    them)."""
    dev = model.kv_cache.device
    lane = make_lane(rows, -(-(context + 1) // BLOCK), 0, dev, seed=rows)
    lane.positions = torch.full_like(lane.positions, context)
    lane.seq_lens = torch.full_like(lane.seq_lens, context + 1)
    meta = lane.meta(BLOCK, model.cfg.num_kv_heads)
    hsz = model.cfg.hidden_size
    kw = ({"input_ids": torch.randint(100, 1000, (rows,), device=dev)} if model.stage.is_first else
          {"hidden": torch.randn(rows, hsz, device=dev, dtype=model.kv_cache.dtype),
           "residual": torch.randn(rows, hsz, device=dev, dtype=model.kv_cache.dtype)})
    out = None
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = graphs.run(meta, **kw)
        if model.stage.is_last:
            out = out.argmax(-1)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    del out
    return float(np.median(times))


def stage_times(shape: str, layers: tuple[int, int] | None, rows: list[int], context: int,
                iters: int, dev) -> dict[int, float]:
    """``{rows: ms}`` of the stage holding ``layers`` (None: the whole model)."""
    stage = random_stage(shape, layers, dev)
    max_len = context + BLOCK + 1
    model = PagedStage(stage, max(rows) * (-(-max_len // BLOCK)) + 8, max_len)
    graphs = DecodeGraphs(model, max(rows), -(-max_len // BLOCK), max_len)
    graphs.capture(progress=False)
    got = {r: step_ms(model, graphs, r, context, iters) for r in rows}
    del graphs, model, stage
    gc.collect()
    torch.cuda.empty_cache()
    return got


def ceilings(t0: dict, t1: dict, full: dict, concurrency: list[int]) -> list[dict]:
    """Per concurrency ``B``: the three round times and the two ceilings (module doc)."""
    rows = []
    for b in concurrency:
        h = b // 2
        sync, over = t0[b] + t1[b], max(2 * t0[h], 2 * t1[h])
        rows.append({"concurrency": b, "sync_round_ms": sync, "overlapped_round_ms": over,
                     "pp1_step_ms": full[b], "ceiling_overlapped_over_sync": sync / over,
                     "ceiling_overlapped_over_pp1": full[b] / over})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.gpu_stage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3-8b,smollm2-135m")
    p.add_argument("--concurrency", default="128,256,512",
                   help="comma list of decode concurrencies B (lanes of B / 2 are timed too)")
    p.add_argument("--context", type=int, default=256,
                   help="cached tokens per row (256 = mean of the decode-heavy workload: "
                   "128-token prompts, 256 new tokens)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("python -m runtime.bench.gpu_stage needs a CUDA device")
    dev = torch.device("cuda", 0)
    conc = [int(x) for x in args.concurrency.split(",")]
    rows = sorted(set(conc) | {b // 2 for b in conc})
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    res = {"date": date, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "command": "python -m runtime.bench.gpu_stage " + " ".join(
               sys.argv[1:] if argv is None else argv), "context": args.context, "shapes": {}}
    for shape in args.shapes.split(","):
        n = model_config(shape).num_layers
        t0 = stage_times(shape, (0, n // 2), rows, args.context, args.iters, dev)
        t1 = stage_times(shape, (n // 2, n), rows, args.context, args.iters, dev)
        full = stage_times(shape, None, conc, args.context, args.iters, dev)
        res["shapes"][shape] = {"first_half_ms": t0, "last_half_ms": t1, "full_ms": full,
                                "ceilings": ceilings(t0, t1, full, conc)}
        print(json.dumps({shape: res["shapes"][shape]}), flush=True)
    out = Path(args.out or f"benchmarks/results/gpu-stage-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
