"""Where a draft-free step with ``--spec-tokens K`` spends more than a spec-off step (issue #33).

For each ``K`` of ``--spec-list`` (0 = off), one engine after another, serves the no-proposal
workload of ``runtime.bench.spec`` (random token-id prompts, seeded temperature sampling, batch 1)
and records, over a fixed window of steps:

* the rank process: a cProfile of steps ``[--window]`` (per-function time per step), and the
  split of its wall time between launching a step (``StageRunner.launch``), waiting for a held
  step's sampled ids (``_Worker._flush``) and waiting for the engine's next step message (the
  rest);
* the engine process (scheduler, result delivery, the asyncio loop): a cProfile of the whole
  workload, per step;
* with ``--torch-steps N``: a ``torch.profiler`` table of N steps after the window on the rank
  (CPU ops and CUDA kernels, counts), to see which kernels a step launches.

Prints per ``K`` the top functions by own time per step and, against ``K = 0``, the functions
whose time per step grew the most. Diagnostic only (no target, no JSON).

    python benchmarks/spec_nodraft_profile.py --device cuda --dtype bfloat16 --model FOLDER \
        --spec-list 0,4 --max-tokens 128 --num-requests 4 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import io
import json
import os
import pstats
import time
from pathlib import Path

from runtime.bench.spec import _serve, prompts
from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.engine import launcher

ENV = "SPEC_NODRAFT_PROFILE"   # JSON {"out": prefix, "start": step, "end": step, "torch": n}


def profiled_entry(args) -> None:
    """The rank process body under the profile that :data:`ENV` describes."""
    from runtime.worker import main as wmain
    from runtime.worker.runner import StageRunner
    conf = json.loads(os.environ[ENV])
    start, end, ntorch = conf["start"], conf["end"], conf["torch"]
    prof, marks = cProfile.Profile(), {"launch": 0.0, "flush": 0.0, "t0": None, "t1": None}
    state = {"n": 0, "tp": None}
    launch, flush = StageRunner.launch, wmain._Worker._flush

    def timed_launch(self, out):
        n = state["n"] = state["n"] + 1
        if n == start:
            marks["t0"] = time.perf_counter()
            prof.enable()
        if n == end:
            prof.disable()
            marks["t1"] = time.perf_counter()
            prof.dump_stats(conf["out"] + ".rank.prof")
            Path(conf["out"] + ".rank.json").write_text(json.dumps(
                {"steps": end - start, "wall_s": marks["t1"] - marks["t0"],
                 "launch_s": marks["launch"], "flush_s": marks["flush"]}))
            if ntorch:
                import torch.profiler as tpf
                acts = [tpf.ProfilerActivity.CPU, tpf.ProfilerActivity.CUDA]
                state["tp"] = tpf.profile(activities=acts)
                state["tp"].__enter__()
        if ntorch and n == end + ntorch and state["tp"] is not None:
            import torch
            torch.cuda.synchronize()
            state["tp"].__exit__(None, None, None)
            ka = state["tp"].key_averages()
            Path(conf["out"] + ".torch.txt").write_text(
                ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
                + ka.table(sort_by="self_device_time_total", row_limit=30))
            state["tp"] = None
        t = time.perf_counter()
        try:
            return launch(self, out)
        finally:
            if start <= n < end:
                marks["launch"] += time.perf_counter() - t

    def timed_flush(self):
        t = time.perf_counter()
        try:
            return flush(self)
        finally:
            if start <= state["n"] < end:
                marks["flush"] += time.perf_counter() - t

    StageRunner.launch, wmain._Worker._flush = timed_launch, timed_flush
    wmain.run_worker(args)


def top(path: str, steps: int, n: int = 25, key: str = "tottime") -> list[tuple[str, float, float, int]]:
    """``(function, own us/step, cumulative us/step, calls/step)`` of a cProfile dump, the ``n``
    largest by ``key``."""
    st = pstats.Stats(path, stream=io.StringIO())
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((f"{Path(fn).name}:{line}:{name}", 1e6 * tt / steps, 1e6 * ct / steps,
                     nc / steps))
    rows.sort(key=lambda r: r[1] if key == "tottime" else r[2], reverse=True)
    return rows[:n] if n else rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec-list", default="0,4")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--window", default="60,360", help="rank steps profiled: START,END")
    p.add_argument("--torch-steps", type=int, default=0)
    p.add_argument("--out", default="bench-results/spec-nodraft-profile")
    add_engine_flags(p)
    args = p.parse_args(argv)
    config = engine_config(p, args)
    start, end = (int(x) for x in args.window.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher._worker_entry = profiled_entry   # spawn pickles the target by name: the ranks run it
    report = {}
    for k in [int(x) for x in args.spec_list.split(",")]:
        prefix = str(out / f"k{k}")
        os.environ[ENV] = json.dumps({"out": prefix, "start": start, "end": end,
                                      "torch": args.torch_steps})
        cfg = config.model_copy(update={"scheduler": dataclasses.replace(
            config.scheduler, num_spec_tokens=k)})
        report[k] = asyncio.run(_profile_engine(cfg, args, prefix))
    lines = []
    for k, r in report.items():
        lines.append(f"== K={k}: {r['tokens_per_s']:.1f} tok/s, {r['steps']} steps, "
                     f"proposed {r['proposed']}, engine {r['engine_us_per_step']:.0f} us/step "
                     f"(cProfile on), rank {json.dumps(r.get('rank'))}")
        for name, tt, ct, nc in top(prefix_of(out, k) + ".rank.prof", end - start, 30):
            lines.append(f"  rank   {tt:8.1f} us own {ct:8.1f} us cum {nc:6.2f}/step  {name}")
        for name, tt, ct, nc in top(prefix_of(out, k) + ".engine.prof", r["steps"], 25):
            lines.append(f"  engine {tt:8.1f} us own {ct:8.1f} us cum {nc:6.2f}/step  {name}")
    ks = list(report)
    for k in ks[1:]:
        for side, steps0, steps1 in (("rank", end - start, end - start),
                                     ("engine", report[ks[0]]["steps"], report[k]["steps"])):
            base = {r[0]: r for r in top(prefix_of(out, ks[0]) + f".{side}.prof", steps0, 0)}
            diff = []
            for name, tt, ct, nc in top(prefix_of(out, k) + f".{side}.prof", steps1, 0):
                b = base.get(name, (name, 0.0, 0.0, 0.0))
                diff.append((tt - b[1], ct - b[2], nc - b[3], name))
            diff.sort(reverse=True)
            lines.append(f"== {side}: K={k} minus K={ks[0]}, own us/step (cum, calls/step)")
            lines += [f"  {d:+8.1f} own {c:+8.1f} cum {n:+6.2f} calls  {name}"
                      for d, c, n, name in diff[:25]]
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text)
    print(text)
    return 0


def prefix_of(out: Path, k: int) -> str:
    return str(out / f"k{k}")


async def _profile_engine(cfg, args, prefix: str) -> dict:
    engine = await AsyncEngine.start(cfg)
    batch = prompts("unfriendly", args.num_requests, 0, None, min(engine.tokenizer.vocab_size, 40000))
    try:
        await _serve(engine, [batch[0]], 8)
        prof = cProfile.Profile()
        prof.enable()
        r = await _serve(engine, batch, args.max_tokens, 1, args.temperature)
        prof.disable()
        prof.dump_stats(prefix + ".engine.prof")
        await asyncio.sleep(0.5)
    finally:
        await engine.shutdown()
    res = {"tokens_per_s": r["output_tokens_per_s"], "steps": r["steps"],
           "proposed": r["proposed_tokens"],
           "engine_us_per_step": 1e6 * r["wall_s"] / max(r["steps"], 1)}
    rank = Path(prefix + ".rank.json")
    if rank.exists():
        res["rank"] = json.loads(rank.read_text())
        w = res["rank"]
        w["us_per_step"] = {x: round(1e6 * w[x + "_s"] / w["steps"], 1)
                            for x in ("wall", "launch", "flush")}
    return res


if __name__ == "__main__":
    raise SystemExit(main())
