"""``python -m runtime.bench pp --overheads``: what tracing or mirror validation costs the engine.

Two engines, the same configuration but for the feature (``off`` / ``on``), start once and take
turns on the same decode workload (``--num-requests`` concurrent greedy requests of
``--prompt-len`` random tokens, ``--max-tokens`` new tokens, EOS ignored), for each concurrency of
``--overheads-concurrency`` (default: ``--num-requests``; each point sends that many requests to
engines sized for the largest). Before the timed rounds each engine runs ``--overheads-warmup``
unrecorded rounds of each point (CUDA graphs and allocator pools of every batch size warm). Then
``--repeats`` rounds, the order alternating ``off on`` / ``on off`` so neither always runs first
after the other's burst. Each round records, per engine: output tokens/s, the ranks' busy seconds
per step (the engine's counter: the forward's host time) and the worker processes' CPU seconds per
step (user + system of every rank process, from ``/proc``: everything a worker does, the
validation included).

``mirror_check_fused`` compares two validating engines: ``on`` sets the check's flag with the
fused Triton kernel (``--mirror-check-kernel fused``), ``off`` with the torch graph (the default).

Reported per point and feature: the on / off ratio of each of the three, round by round (median,
min, max, all: :func:`runtime.bench.engine_runs.ratio_summary`), and their medians per engine.
"""

from __future__ import annotations

import asyncio
import statistics
from contextlib import AsyncExitStack

import os

from runtime.bench.engine_runs import ratio_summary, run_workload
from runtime.config import EngineConfig
from runtime.engine import AsyncEngine


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc/PID/stat``, fields 14 and 15
    in clock ticks); 0 when it is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # after the command name
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_cpu_s(engine: AsyncEngine) -> float:
    """User + system CPU seconds of ``engine``'s worker processes so far."""
    return sum(process_cpu_s(proc.pid) for proc in engine.pool.procs)


async def _round(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """One workload on ``engine`` (:func:`runtime.bench.engine_runs.run_workload`) plus its workers' CPU
    seconds per step (``worker_cpu_s_per_step``)."""
    c0 = worker_cpu_s(engine)
    run = await run_workload(engine, prompts, max_tokens, tag)
    run["worker_cpu_s"] = worker_cpu_s(engine) - c0
    run["worker_cpu_s_per_step"] = run["worker_cpu_s"] / max(1, run["steps"])
    return run


def summarize(n: int, runs: dict[str, list[dict]]) -> dict:
    """On / off ratios of one point's rounds: throughput, busy and worker CPU seconds per step."""

    def col(name: str, key: str) -> list[float]:
        return [sum(r[key]) if isinstance(r[key], list) else r[key] for r in runs[name]]
    out = {"concurrency": n, "runs": runs}
    for key, label in (("output_tokens_per_s", "on_over_off"),
                       ("busy_s_per_step", "busy_per_step_on_over_off"),
                       ("worker_cpu_s_per_step", "worker_cpu_per_step_on_over_off")):
        out[label] = ratio_summary(col("on", key), col("off", key))
        for name in ("off", "on"):
            out[f"{name}_{key}"] = statistics.median(col(name, key))
    return out


async def _pair(configs: dict[str, EngineConfig], points: list[int], prompts, max_tokens: int,
                repeats: int, warmup: int, label: str) -> list[dict]:
    rows = []
    async with AsyncExitStack() as stack:
        engines = {}
        for name, cfg in configs.items():
            eng = await AsyncEngine.start(cfg)
            stack.push_async_callback(eng.shutdown)
            engines[name] = eng
        for n in points:
            for w in range(warmup):
                for name, eng in engines.items():
                    await _round(eng, prompts(n, -1 - w), max_tokens, f"warm-{name}-{n}-{w}")
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for i in range(repeats):
                for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    run = await _round(engines[name], prompts(n, i), max_tokens,
                                       f"{label}-{name}-{n}-{i}")
                    runs[name].append(run)
                    print(f"  {label} {n:4d} {name:>3s} round {i}: "
                          f"{run['output_tokens_per_s']:.5g} tok/s, worker CPU "
                          f"{1e6 * run['worker_cpu_s_per_step']:.0f} us/step", flush=True)
            rows.append(summarize(n, runs))
    return rows


def overheads(base: EngineConfig, args, prompts) -> dict:
    """Each feature of ``args.overheads_of`` on / off at each concurrency (module docstring).
    ``prompts(n, round)``: the round's ``n`` prompts (the same for both engines). Returns, per
    feature, ``{"on_over_off", "runs"}`` of the first point (the headline), ``"points"`` (every
    point's :func:`summarize`), and ``<feature>_overhead`` = 1 - its median ratio."""
    import tempfile
    points = ([int(x) for x in args.overheads_concurrency.split(",")]
              if args.overheads_concurrency else [args.num_requests])
    base = base.replace(max_num_seqs=max(base.scheduler.max_num_seqs, max(points)))
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
        pairs = {"trace": ({"trace_dir": None}, {"trace_dir": tmp}),
                 "mirror_validation": ({"validate_mirrors": "off"}, {"validate_mirrors": "every"}),
                 # "on" = the fused check kernel, "off" = the graph one, both validating
                 "mirror_check_fused": ({"validate_mirrors": "every"},
                                        {"validate_mirrors": "every",
                                         "mirror_check_kernel": "fused"})}
        for what in (w.strip() for w in args.overheads_of.split(",")):
            off, on = pairs[what]
            rows = asyncio.run(_pair({"off": base.replace(**off), "on": base.replace(**on)},
                                     points, prompts, args.max_tokens, args.repeats,
                                     args.overheads_warmup, what))
            out[what] = {"on_over_off": rows[0]["on_over_off"], "runs": rows[0]["runs"],
                         "points": rows}
            out[f"{what}_overhead"] = 1.0 - rows[0]["on_over_off"]["median"]
            for r in rows:
                t, c = r["on_over_off"], r["worker_cpu_per_step_on_over_off"]
                print(f"{what} at {r['concurrency']}: on/off throughput {t['median']:.3f} "
                      f"(min {t['min']:.3f}, max {t['max']:.3f}), worker CPU per step "
                      f"{c['median']:.3f} ({1e6 * r['off_worker_cpu_s_per_step']:.0f} -> "
                      f"{1e6 * r['on_worker_cpu_s_per_step']:.0f} us)", flush=True)
    return out
