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
step (every thread of every rank process, the kernel's nanosecond run time from ``/proc``:
everything a worker does, the validation included; :mod:`runtime.bench.proc_cpu`), and the
microseconds of worker CPU per step that ``on`` adds round by round
(``worker_cpu_us_per_step_added``). With ``--overheads-pin`` this process and each engine's
ranks run on disjoint thirds of the cores, so an engine's idle ranks never share a core with the
other's busy ones (``cores`` per point).

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
from runtime.bench.proc_cpu import pin, process_cpu_s, split_cores, tasks_cpu_s  # noqa: F401
from runtime.config import EngineConfig
from runtime.engine import AsyncEngine


def worker_cpu_s(engine: AsyncEngine) -> float:
    """CPU seconds of ``engine``'s worker processes so far (every thread, nanosecond run time
    where the kernel keeps it: :func:`~runtime.bench.proc_cpu.tasks_cpu_s`)."""
    return sum(tasks_cpu_s(proc.pid) for proc in engine.pool.procs)


def pin_engines(engines: dict) -> dict | None:
    """Pin this process and each engine's rank processes onto disjoint cores
    (:func:`~runtime.bench.proc_cpu.split_cores`: this process first, then the engines in
    order); returns ``{"bench": [cores], name: [cores], ...}``, or None with too few cores."""
    groups = split_cores(1 + len(engines))
    if groups is None:
        return None
    pin(os.getpid(), groups[0])
    out = {"bench": sorted(groups[0])}
    for (name, eng), cores in zip(engines.items(), groups[1:]):
        for proc in eng.pool.procs:
            pin(proc.pid, cores)
        out[name] = sorted(cores)
    return out


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
    added = [1e6 * (a - b) for a, b in zip(col("on", "worker_cpu_s_per_step"),
                                            col("off", "worker_cpu_s_per_step"))]
    if added:   # what validation adds to a step's worker CPU, round by round (us)
        out["worker_cpu_us_per_step_added"] = {"median": statistics.median(added),
                                               "min": min(added), "max": max(added),
                                               "all": added}
    for key, label in (("output_tokens_per_s", "on_over_off"),
                       ("busy_s_per_step", "busy_per_step_on_over_off"),
                       ("worker_cpu_s_per_step", "worker_cpu_per_step_on_over_off")):
        out[label] = ratio_summary(col("on", key), col("off", key))
        for name in ("off", "on"):
            out[f"{name}_{key}"] = statistics.median(col(name, key))
    return out


async def _pair(configs: dict[str, EngineConfig], points: list[int], prompts, max_tokens: int,
                repeats: int, warmup: int, label: str, pin_cores: bool = False) -> list[dict]:
    rows = []
    async with AsyncExitStack() as stack:
        engines = {}
        for name, cfg in configs.items():
            eng = await AsyncEngine.start(cfg)
            stack.push_async_callback(eng.shutdown)
            engines[name] = eng
        cores = pin_engines(engines) if pin_cores else None
        if pin_cores:
            print(f"  {label}: cores {cores if cores else 'not pinned (too few cores)'}",
                  flush=True)
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
            rows.append(summarize(n, runs) | {"cores": cores})
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
                                     args.overheads_warmup, what,
                                     getattr(args, "overheads_pin", False)))
            out[what] = {"on_over_off": rows[0]["on_over_off"], "runs": rows[0]["runs"],
                         "points": rows}
            out[f"{what}_overhead"] = 1.0 - rows[0]["on_over_off"]["median"]
            for r in rows:
                t, c = r["on_over_off"], r["worker_cpu_per_step_on_over_off"]
                b = r["busy_per_step_on_over_off"]
                print(f"{what} at {r['concurrency']}: on/off throughput {t['median']:.3f} "
                      f"(min {t['min']:.3f}, max {t['max']:.3f}), busy per step {b['median']:.3f}, "
                      f"worker CPU per step {c['median']:.3f} "
                      f"({1e6 * r['off_worker_cpu_s_per_step']:.0f} -> "
                      f"{1e6 * r['on_worker_cpu_s_per_step']:.0f} us, added per round: median "
                      f"{r['worker_cpu_us_per_step_added']['median']:.0f} us)", flush=True)
    return out
