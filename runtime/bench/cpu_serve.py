"""``python -m runtime.bench cpu-serve``: the CPU serving table of issue #34, in one run.

Starts each server in turn on this machine, loads it with the same client
(:mod:`runtime.bench.serve`: streamed ``/v1/completions``, ``--input-len`` random-token prompts,
``--output-len`` new tokens, greedy, EOS ignored) at 1 stream and at ``--concurrency`` streams,
records output tokens/s, TTFT / TPOT and the resident memory (RSS) of each rank process, then
stops it. Servers: ppstate ``--pp 1`` and ``--pp 2``, each with ``--cpu-path fast`` and
``--cpu-path exact``, and llama.cpp's ``llama-server`` on the same GGUF when ``--llama-server``
names the binary (``-t <cores> -np <concurrency>``; how to build it: docs/cpu_fast_path.md).
Figures of one run on a shared machine are comparable with each other (ratios), not across runs.
With ``--rounds N`` every server runs N times, the servers taking turns (round i starts with the
i-th server), so a drift of the machine's load hits all alike; a server's figures are then the
medians over its rounds, and the PP=2 / PP=1 ratio is also given round by round. During the
concurrent load the CPU time of each process is recorded (``cores``: CPU seconds per second of
the load; ``tok_per_core_s``: output tokens per CPU second of the server and its ranks): on a
machine shared with other jobs a server's CPU share is capped, and tokens per CPU second decide.

Usage: ``python -m runtime.bench cpu-serve [--llama-server PATH] [--only fast-pp1,...]
[--rounds N] [--json-out benchmarks/results/cpu-serve-DATE.json]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
import psutil

from runtime.bench.results import subcommand_line, write_result
from runtime.bench.serve import build_parser as serve_parser, run as run_load
from runtime.model.registry import default_model_path

CONFIGS = {  # name -> ppstate serve flags
    "fast-pp1": ["--pp", "1", "--cpu-path", "fast"],
    "fast-pp2": ["--pp", "2", "--cpu-path", "fast"],
    "fast-pp2-pinned": ["--pp", "2", "--cpu-path", "fast", "--cpu-pin"],
    "fast-pp2-split": ["--pp", "2", "--cpu-path", "fast", "--cpu-threads", str(os.cpu_count())],
    "fast-pp2-lanes": ["--pp", "2", "--cpu-path", "fast", "--no-adaptive-lanes"],
    "exact-pp1": ["--pp", "1", "--cpu-path", "exact"],
    "exact-pp2": ["--pp", "2", "--cpu-path", "exact"],
}

#: configurations run only when ``--only`` names them (variants of fast-pp2, whose ranks may each
#: use every core and whose decode rows fill one lane (serve's default on the fast CPU path):
#: pinned ranks; the cores' threads split between the ranks; every lane filled, the old default)
VARIANTS = ("fast-pp2-pinned", "fast-pp2-split", "fast-pp2-lanes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench cpu-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="llama.cpp llama-server binary")
    p.add_argument("--only", default=None, help="comma-separated subset of: llama.cpp, "
                   + ", ".join(CONFIGS))
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--single-prompts", type=int, default=3, help="requests of the 1-stream run")
    p.add_argument("--rounds", type=int, default=1, help="runs of every server, taking turns")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--kv-cache-memory", default="128MB", help="ppstate: KV cache per rank (the "
                   "same for both paths, so the ranks' RSS differ by the weights)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    return p


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll ``/health`` until 200; raises RuntimeError if the server exits or times out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout} s")


def _rss_mib(proc: subprocess.Popen) -> dict:
    """RSS (MiB) of the server process and of each child process (the ranks)."""
    p = psutil.Process(proc.pid)
    kids = [c for c in p.children(recursive=True) if c.is_running()]
    mib = lambda q: round(q.memory_info().rss / 2**20, 1)  # noqa: E731
    return {"server": mib(p), "children": sorted((mib(c) for c in kids), reverse=True)}


def _cpu_seconds(procs: list[psutil.Process]) -> list[float]:
    """User + system CPU seconds of each process so far (0 for one that has exited)."""
    out = []
    for q in procs:
        try:
            t = q.cpu_times()
            out.append(t.user + t.system)
        except psutil.Error:
            out.append(0.0)
    return out


def _load(url: str, args: argparse.Namespace, prompts: int, concurrency: int, seed: int) -> dict:
    """One load of ``runtime.bench serve`` (one client process); ``seed`` picks the random prompts
    (each load its own, so no load reuses a prompt a server has cached)."""
    a = serve_parser().parse_args(["--url", url, "--input-len", str(args.input_len),
                                   "--output-len", str(args.output_len), "--num-prompts",
                                   str(prompts), "--max-concurrency", str(concurrency),
                                   "--seed", str(seed), "--no-progress"])
    return run_load(a)


def run_server(name: str, cmd: list[str], args: argparse.Namespace, round_no: int = 0) -> dict:
    """Start ``cmd``, warm it up, run the 1-stream and the concurrent load (fresh prompts each
    round), stop it; the concurrent load's CPU use per process (``cores``: server, then its
    children by pid) and output tokens per CPU second (``tok_per_core_s``)."""
    url = f"http://127.0.0.1:{args.port}"
    print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_ready(url, proc, args.start_timeout)
        start_s = time.monotonic() - t0
        _load(url, args, 1, 1, seed=1)   # warm-up
        single = _load(url, args, args.single_prompts, 1, seed=2 + 2 * round_no)
        procs = [psutil.Process(proc.pid)]
        procs += [c for c in procs[0].children(recursive=True) if c.is_running()]
        c0, t1 = _cpu_seconds(procs), time.monotonic()
        multi = _load(url, args, 2 * args.concurrency, args.concurrency, seed=3 + 2 * round_no)
        c1, dt = _cpu_seconds(procs), time.monotonic() - t1
        rss = _rss_mib(proc)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    keep = ("output_throughput", "ttft_mean_ms", "tpot_mean_ms", "completed", "failed", "errors")
    cores = [round((b - a) / dt, 3) for a, b in zip(c0, c1)]
    many = {k: multi[k] for k in keep}
    many["cores"] = {"server": cores[0], "children": cores[1:]}
    many["tok_per_core_s"] = round(multi["output_throughput"] / max(sum(cores), 1e-9), 1)
    res = {"name": name, "command": " ".join(cmd), "start_s": round(start_s, 1), "rss_mib": rss,
           "single": {k: single[k] for k in keep}, f"concurrent_{args.concurrency}": many}
    print(f"[{name}] 1 stream {single['output_throughput']:.1f} tok/s, {args.concurrency} streams "
          f"{multi['output_throughput']:.1f} tok/s on {sum(cores):.2f} cores "
          f"({many['tok_per_core_s']} tok per CPU s), RSS {rss}", file=sys.stderr, flush=True)
    return res


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Server name -> command line, in run order."""
    out = {}
    if args.llama_server:
        cores = len(os.sched_getaffinity(0))
        out["llama.cpp"] = [args.llama_server, "-m", str(default_model_path()), "--port",
                            str(args.port), "-t", str(cores), "-np", str(args.concurrency),
                            "-c", str(args.concurrency * (args.input_len + args.output_len + 16))]
    for name, flags in CONFIGS.items():
        if name in VARIANTS and not args.only:
            continue
        out[name] = [sys.executable, "-m", "runtime.serve", "--port", str(args.port), *flags,
                     "--kv-cache-memory", args.kv_cache_memory]
    if args.only:
        keep = args.only.split(",")
        out = {k: v for k, v in out.items() if k in keep}
    return out


def ratios(results: dict, conc: int) -> dict:
    """Each server's tok/s over llama.cpp's (when run) and PP=2 over PP=1 at ``conc`` streams."""
    tps = {n: (r["single"]["output_throughput"], r[f"concurrent_{conc}"]["output_throughput"])
           for n, r in results.items()}
    out = {}
    if "llama.cpp" in tps:
        base = tps["llama.cpp"]
        out["vs_llama_cpp"] = {n: [round(a / base[0], 3), round(b / base[1], 3)]
                               for n, (a, b) in tps.items() if n != "llama.cpp"}
    for path in ("fast", "exact"):
        if f"{path}-pp1" in tps and f"{path}-pp2" in tps:
            out[f"{path}_pp2_over_pp1_concurrent"] = round(tps[f"{path}-pp2"][1] / tps[f"{path}-pp1"][1], 3)
    if "fast-pp2" in tps and "exact-pp2" in tps:
        out["fast_over_exact_pp2"] = [round(tps["fast-pp2"][i] / tps["exact-pp2"][i], 3) for i in (0, 1)]
    return out


def merge_rounds(runs: list[dict], conc: int) -> dict:
    """One server's result over its rounds: the first run's fields, ``single`` and
    ``concurrent_<conc>`` throughputs / TTFT / TPOT / tokens per CPU second replaced by their
    medians, and ``rounds``: each round's output tokens/s at 1 and ``conc`` streams."""
    out = dict(runs[0])
    for part in ("single", f"concurrent_{conc}"):
        out[part] = dict(runs[0][part])
        for k in ("output_throughput", "ttft_mean_ms", "tpot_mean_ms", "tok_per_core_s"):
            vals = [r[part][k] for r in runs if r[part].get(k) is not None]
            if vals:
                out[part][k] = round(statistics.median(vals), 2)
    out["rounds"] = [[r["single"]["output_throughput"], r[f"concurrent_{conc}"]["output_throughput"]]
                     for r in runs]
    return out


def round_ratios(results: dict, conc: int) -> dict:
    """PP=2 / PP=1 output tokens/s at ``conc`` streams in each round (servers with ``rounds``),
    for every PP=2 server over the PP=1 server of its path."""
    out = {}
    for name, r in results.items():
        base = results.get(name.split("-")[0] + "-pp1")
        if "-pp2" not in name or base is None or "rounds" not in r or "rounds" not in base:
            continue
        out[name] = [round(a[1] / b[1], 3) for a, b in zip(r["rounds"], base["rounds"])]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmds = commands(args)
    names = list(cmds)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            if name in errors:
                continue
            try:
                runs[name].append(run_server(name, cmds[name], args, rnd))
            except RuntimeError as exc:
                errors[name] = {"name": name, "command": " ".join(cmds[name]), "error": str(exc)}
                print(f"[{name}] {exc}", file=sys.stderr)
    results = {n: errors[n] if n in errors else
               (runs[n][0] if args.rounds == 1 else merge_rounds(runs[n], args.concurrency))
               for n in names}
    ok = {n: r for n, r in results.items() if "error" not in r}
    report = {"servers": results, "ratios": ratios(ok, args.concurrency)}
    if args.rounds > 1:
        report["ratios"]["pp2_over_pp1_concurrent_by_round"] = round_ratios(ok, args.concurrency)
    print(report["ratios"])
    if args.json_out:
        write_result(args.json_out, "cpu_serve", report, vars(args), subcommand_line("cpu-serve", argv))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
