"""``python -m runtime.bench pp``: overlapped vs sync on the real model, interleaved A B A B.

Every compared configuration gets its own engine (same model and flags otherwise); the engines of
one comparison stay up and take turns on the same workload (``--repeats`` rounds, warm-up first),
so slow drifts of a shared machine hit both alike. Reported per run and as pairwise ratios (median,
min, max over the rounds):

* ``decode``: ``--num-requests`` concurrent greedy requests, ``--prompt-len``-token random prompts,
  ``--max-tokens`` new tokens (EOS ignored); output tokens/s. ``throughput_ratio`` = overlapped /
  sync, ``efficiency`` = throughput_ratio / pp_size.
* ``prefill``: TTFT of ``--prefill-prompts`` long prompts (``--prefill-len`` tokens, chunks of
  ``--max-prefill-chunk``; one new token). ``ttft_ratio`` = sync / overlapped; with
  ``--chunks`` also fixed vs dynamic chunk sizing (``dynamic_chunk_ttft_ratio`` = fixed /
  dynamic, overlapped mode).
* ``--sweep 1,2,4,...``: the decode workload at each concurrency for sync, overlapped and
  overlapped with adaptive lanes; the ratio to sync at each point. The engines' order rotates
  from round to round (round i starts with the i-th), so none always follows another.
* ``--overheads``: tracing (``--trace-dir``) and mirror validation (``every`` vs ``off``) as
  throughput and worker-CPU-per-step ratios on the decode workload, at each concurrency of
  ``--overheads-concurrency``, on / off alternating (:mod:`runtime.bench.pp_overheads`;
  ``trace_overhead`` = 1 - on / off).
* ``--calibrate``: fit the step-cost model (:mod:`ppstate.step_cost`) to the ranks' busy seconds
  per step of the sweep and prefill runs; written under ``step_cost`` (load with
  ``--step-cost FILE``).

``--json-out F`` writes everything with date, machine and command (:mod:`runtime.bench.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from contextlib import AsyncExitStack

from runtime.bench.engine_runs import (ratio_summary, run_workload,  # noqa: F401 (re-export)
                                       stream_timed, timed_request)
from runtime.bench.results import subcommand_line, write_result
from runtime.cli_common import add_engine_flags, engine_config
from runtime.config import EngineConfig
from runtime.engine import AsyncEngine


async def interleaved(configs: dict[str, EngineConfig], workloads: list[tuple],
                      repeats: int) -> dict[str, dict[str, list[dict]]]:
    """Start one engine per config, warm each up, then run every workload ``repeats`` rounds in
    turn (A B A B ...). A workload is ``(label, engine names, prompts, max_tokens, metric)``:
    ``prompts(round)`` gives each round's prompts (new ones every round, so no round hits the
    prefix cache of an earlier one; the same for every engine). Returns label -> name -> runs."""
    runs = {w[0]: {k: [] for k in w[1]} for w in workloads}
    async with AsyncExitStack() as stack:
        engines = {}
        for name, cfg in configs.items():
            eng = await AsyncEngine.start(cfg)
            stack.push_async_callback(eng.shutdown)
            await timed_request(eng, f"warm-{name}", [99] * 8, 4)
            engines[name] = eng
        for label, names, prompts, max_tokens, metric in workloads:
            for i in range(repeats):
                for name in names:
                    run = await run_workload(engines[name], prompts(i), max_tokens,
                                             f"{label}-{name}-{i}")
                    runs[label][name].append(run)
                    print(f"  {label} {name:>26s} round {i}: {metric} {run[metric]:.4g}",
                          flush=True)
    return runs


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _variants(base: EngineConfig, **named: dict) -> dict[str, EngineConfig]:
    return {name: base.replace(**upd) for name, upd in named.items()}


def compare(base: EngineConfig, args) -> dict:
    """Sync vs overlapped on the decode-heavy and / or the long-prompt workload, on the same
    engines (plus one with dynamic chunks for the prefill workload with ``--chunks``)."""
    named = {"sync": {"mode": "sync"}, "overlapped": {"mode": "overlapped"}}
    work = []
    if args.workload in ("decode", "both"):
        work.append(("decode", ["sync", "overlapped"], lambda i: _prompts(
            args.num_requests, args.prompt_len, args.seed + 1000 * i), args.max_tokens,
            "output_tokens_per_s"))
    if args.workload in ("prefill", "both"):
        modes = ["sync", "overlapped"]
        if args.chunks:
            named["overlapped+dynamic_chunks"] = {"mode": "overlapped",
                                                  "dynamic_chunks": True}
            modes.append("overlapped+dynamic_chunks")
        work.append(("prefill", modes, lambda i: _prompts(
            args.prefill_prompts, args.prefill_len, args.seed + 1 + 1000 * i), 1, "max_ttft_s"))
    runs = asyncio.run(interleaved(_variants(base, **named), work, args.repeats))
    out = {}
    if "decode" in runs:
        tp = {k: [r["output_tokens_per_s"] for r in v] for k, v in runs["decode"].items()}
        ratio = ratio_summary(tp["overlapped"], tp["sync"])
        out["decode"] = {"runs": runs["decode"], "throughput_ratio": ratio["median"],
                         "throughput_ratio_spread": ratio,
                         "efficiency": ratio["median"] / base.scheduler.pp_size,
                         "sync_output_tokens_per_s": statistics.median(tp["sync"]),
                         "overlapped_output_tokens_per_s": statistics.median(tp["overlapped"])}
    if "prefill" in runs:
        ttft = {k: [r["max_ttft_s"] for r in v] for k, v in runs["prefill"].items()}
        ratio = ratio_summary(ttft["sync"], ttft["overlapped"])
        pre = {"runs": runs["prefill"], "ttft_ratio": ratio["median"], "ttft_ratio_spread": ratio,
               "sync_ttft_s": statistics.median(ttft["sync"]),
               "overlapped_ttft_s": statistics.median(ttft["overlapped"])}
        if args.chunks:
            dyn = ratio_summary(ttft["overlapped"], ttft["overlapped+dynamic_chunks"])
            pre.update(dynamic_chunk_ttft_ratio=dyn["median"],
                       dynamic_chunk_ttft_ratio_spread=dyn,
                       dynamic_chunks_ttft_s=statistics.median(ttft["overlapped+dynamic_chunks"]))
        out["prefill"] = pre
    return out


def sweep(base: EngineConfig, args, points: list[int]) -> dict:
    """Decode throughput at each concurrency: sync, overlapped, overlapped + adaptive lanes."""
    cfg = base.replace(max_num_seqs=max(base.scheduler.max_num_seqs, max(points)))
    named = {"sync": {"mode": "sync"}, "overlapped": {"mode": "overlapped"},
             "overlapped+adaptive_lanes": {"mode": "overlapped", "adaptive_lanes": True}}
    if args.no_adaptive:
        named.pop("overlapped+adaptive_lanes")
    rows = []

    async def all_points() -> None:
        async with AsyncExitStack() as stack:
            engines = {}
            for name, c in _variants(cfg, **named).items():
                eng = await AsyncEngine.start(c)
                stack.push_async_callback(eng.shutdown)
                await timed_request(eng, f"warm-{name}", [99] * 8, 4)
                engines[name] = eng
            for n in points:
                runs: dict[str, list[dict]] = {k: [] for k in engines}
                names = list(engines)
                for i in range(args.repeats):
                    prompts = _prompts(n, args.prompt_len, args.seed + n + 1000 * i)
                    # the order rotates round by round: no mode always runs right after another
                    for name in names[i % len(names):] + names[:i % len(names)]:
                        runs[name].append(await run_workload(engines[name], prompts,
                                                             args.max_tokens, f"{name}-{n}-{i}"))
                tp = {k: [r["output_tokens_per_s"] for r in v] for k, v in runs.items()}
                row = {"concurrency": n, "runs": runs,
                       **{f"{k}_output_tokens_per_s": statistics.median(v) for k, v in tp.items()}}
                for k in tp:
                    if k != "sync":
                        row[f"{k}_over_sync"] = ratio_summary(tp[k], tp["sync"])
                rows.append(row)
                print(f"concurrency {n:4d}: " + ", ".join(
                    f"{k} {statistics.median(v):.1f}" for k, v in tp.items()) + " tok/s", flush=True)
    asyncio.run(all_points())
    return {"points": rows}


def overheads(base: EngineConfig, args) -> dict:
    """Tracing and mirror validation on / off, decode workload (:mod:`runtime.bench.pp_overheads`)."""
    from runtime.bench.pp_overheads import overheads as measure
    return measure(base, args, lambda n, i: _prompts(n, args.prompt_len, args.seed + n + 1000 * i))


def calibrate(sweep_res: dict | None, prefill_res: dict | None, pp_size: int,
              prefill_len: int, chunk: int) -> dict:
    """Fit :class:`ppstate.step_cost.StepCostModel` to mean rank busy seconds per step: sync
    decode runs (``rows`` = concurrency), sync prefill runs (one row per chunk step, prefix
    pairs averaged per step); ``concurrency`` = median over sweep points of overlapped busy per
    step over the fitted cost of its ``ceil(n / pp_size)``-row steps."""
    from ppstate.step_cost import fit
    samples = []
    for pt in (sweep_res or {}).get("points", []):
        n = pt["concurrency"]
        for r in pt["runs"]["sync"]:
            samples.append((n, n, 0.0, statistics.mean(r["busy_s_per_step"])))
    if prefill_res:
        steps = -(-prefill_len // chunk)
        pairs = prefill_len * prefill_len / 2.0 / steps
        for r in prefill_res["runs"]["sync"]:
            samples.append((1, prefill_len / steps, pairs, statistics.mean(r["rank_busy_s"]) / steps))
    model = fit(samples)
    slow = []
    for pt in (sweep_res or {}).get("points", []):
        rows = -(-pt["concurrency"] // pp_size)
        for r in pt["runs"]["overlapped"]:
            slow.append(statistics.mean(r["busy_s_per_step"]) / model.step_s(rows, rows))
    conc = max(1.0, statistics.median(slow)) if slow else 1.0
    return fit(samples, concurrency=conc).to_dict() | {"num_samples": len(samples)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench pp", description=__doc__)
    p.add_argument("--workload", choices=["decode", "prefill", "both", "none"], default="both")
    p.add_argument("--repeats", type=int, default=3, help="rounds of A B (median ratios)")
    p.add_argument("--num-requests", type=int, default=32, help="decode: concurrent requests")
    p.add_argument("--prompt-len", type=int, default=32, help="decode: prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="decode: new tokens")
    p.add_argument("--prefill-len", type=int, default=1024, help="prefill: prompt tokens")
    p.add_argument("--prefill-prompts", type=int, default=1, help="prefill: long prompts at once")
    p.add_argument("--chunks", action="store_true", help="prefill: also dynamic chunk sizing")
    p.add_argument("--sweep", default=None, help="comma list of concurrencies (decode curve)")
    p.add_argument("--no-adaptive", action="store_true", help="sweep without adaptive lanes")
    p.add_argument("--overheads", action="store_true", help="tracing / mirror validation cost")
    p.add_argument("--overheads-of", default="trace,mirror_validation",
                   help="comma list of what --overheads measures: trace, mirror_validation, "
                        "mirror_check_fused (fused vs graph check kernel, both validating)")
    p.add_argument("--overheads-concurrency", default=None,
                   help="comma list of concurrencies for --overheads (default: --num-requests)")
    p.add_argument("--overheads-warmup", type=int, default=1,
                   help="unrecorded rounds per engine and concurrency before --overheads' rounds")
    p.add_argument("--overheads-pin", action="store_true",
                   help="--overheads: pin this process and each engine's ranks onto disjoint "
                        "thirds of the usable cores (runtime/bench/proc_cpu.py)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the step-cost model to the sweep and prefill runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    add_engine_flags(p)
    p.set_defaults(max_prefill_chunk=64, max_model_len=2048)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1 or args.prefill_len < 2:
        p.error("--repeats and --num-requests must be >= 1, --prefill-len >= 2")
    try:
        points = [int(x) for x in args.sweep.split(",")] if args.sweep else []
    except ValueError:
        p.error(f"--sweep must be a comma list of integers, got {args.sweep!r}")
    if set(args.overheads_of.split(",")) - {"trace", "mirror_validation", "mirror_check_fused"}:
        p.error("--overheads-of takes a comma list of trace, mirror_validation, "
                "mirror_check_fused")
    try:
        if args.overheads_concurrency and min(
                int(x) for x in args.overheads_concurrency.split(",")) < 1:
            raise ValueError
    except ValueError:
        p.error("--overheads-concurrency must be a comma list of integers >= 1")
    if args.calibrate and (not points or args.workload not in ("prefill", "both")):
        p.error("--calibrate needs --sweep (decode rows) and --workload prefill or both")
    base = engine_config(p, args)
    if args.workload in ("prefill", "both") and args.prefill_len >= base.scheduler.max_model_len:
        p.error("--prefill-len must be < --max-model-len")
    res: dict = {"pp_size": base.scheduler.pp_size}
    if args.workload != "none":
        res.update(compare(base, args))
    if "decode" in res:
        res["throughput_ratio"] = res["decode"]["throughput_ratio"]
        res["efficiency"] = res["decode"]["efficiency"]
        print(f"throughput_ratio {res['throughput_ratio']:.3f} (spread "
              f"{res['decode']['throughput_ratio_spread']['min']:.3f}.."
              f"{res['decode']['throughput_ratio_spread']['max']:.3f}), efficiency "
              f"{res['efficiency']:.3f}", flush=True)
    if "prefill" in res:
        res["ttft_ratio"] = res["prefill"]["ttft_ratio"]
        if args.chunks:
            res["dynamic_chunk_ttft_ratio"] = res["prefill"]["dynamic_chunk_ttft_ratio"]
        print(f"ttft_ratio {res['ttft_ratio']:.3f}" + (
            f", dynamic_chunk_ttft_ratio {res['prefill']['dynamic_chunk_ttft_ratio']:.3f}"
            if args.chunks else ""), flush=True)
    if points:
        res["sweep"] = sweep(base, args, points)
    if args.overheads:
        res["overheads"] = overheads(base, args)
        for what in ("trace", "mirror_validation"):
            if f"{what}_overhead" in res["overheads"]:
                res[f"{what}_overhead"] = res["overheads"][f"{what}_overhead"]
    if args.calibrate:
        res["step_cost"] = calibrate(res.get("sweep"), res.get("prefill"), base.scheduler.pp_size,
                                     args.prefill_len, base.scheduler.max_prefill_chunk)
        print(f"step_cost {res['step_cost']}", flush=True)
    if args.json_out:
        write_result(args.json_out, "pp", res, vars(args),
                     subcommand_line("pp", argv))
        print(f"wrote {args.json_out}")
    return 0
