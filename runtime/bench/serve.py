"""``python -m runtime.bench serve``: load an OpenAI-compatible server, like ``vllm bench serve``.

Sends ``--num-prompts`` streamed ``/v1/completions`` requests (greedy, EOS ignored) from the
``--dataset``: ``random`` (``--input-len`` random token ids, ``--output-len`` new tokens) or a
JSON / JSONL file of prompts or conversations with a real length distribution
(:mod:`runtime.bench.datasets`), at most ``--max-concurrency`` at once, arriving as a Poisson
process of ``--request-rate`` requests/s (``inf``: all at once). The client runs on aiohttp in
``--num-clients`` processes (:mod:`runtime.bench.serve_client`), so one Python process is not what
limits the figures. Reports request throughput, output and total tokens/s, TTFT / TPOT / ITL / E2E
mean, median, p90, p99 (:mod:`runtime.bench.metrics`), and the CPU share of every client process
(a warning when one is near a full core: then the client, not the server, sets the figures; add
``--num-clients``); with ``--server-pid PID[,PID...]`` also the CPU share of those server
processes over the run. ``--json-out F`` writes it all with date, machine and command
(:mod:`runtime.bench.results`).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from tqdm import tqdm

from runtime.bench.datasets import BenchRequest, file_requests, random_prompts, random_requests
from runtime.bench.metrics import summarize
from runtime.bench.proc_cpu import process_cpu_s
from runtime.bench.results import subcommand_line, write_result
from runtime.bench.serve_client import ClientConfig, ClientRun, run_clients

__all__ = ["build_parser", "check_args", "main", "random_prompts"]

#: a client process above this share of one core is saturated: its figures measure the client
SATURATED_CPU = 0.85


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default="default", help="model name sent in each request")
    p.add_argument("--dataset", default="random", metavar="random|FILE",
                   help="random: prompts of random token ids (ids 100..39999); FILE: a .json / "
                   ".jsonl file of prompts or conversations (runtime/bench/datasets.py)")
    p.add_argument("--tokenizer", default="default",
                   help="with a FILE dataset: the model whose tokenizer counts prompt and reply "
                   "tokens ('default', a .gguf file or an HF folder)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="with a FILE dataset: skip entries whose prompt + output exceed this")
    p.add_argument("--input-len", type=int, default=32, help="random: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (random; a "
                   "FILE entry without a reply or output_len)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals); inf: send all at once")
    p.add_argument("--num-clients", type=int, default=1,
                   help="client processes sharing the load (concurrency and rate split evenly)")
    p.add_argument("--server-pid", default=None, metavar="PID[,PID...]",
                   help="report the CPU share of these server processes over the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through ``p.error`` naming the flag of the first bad value."""
    for flag in ("input_len", "output_len", "num_prompts", "num_clients", "max_model_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.dataset != "random" and not Path(args.dataset).is_file():
        p.error(f"--dataset: no file {args.dataset!r} (or use 'random')")
    if args.server_pid is not None:
        try:
            [int(x) for x in args.server_pid.split(",")]
        except ValueError:
            p.error(f"--server-pid: expected PID[,PID...], got {args.server_pid!r}")


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests of ``--dataset``."""
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, args.seed)
    from runtime.model.registry import resolve_model_path
    from runtime.model.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model_path(args.tokenizer))
    return file_requests(args.dataset, args.num_prompts,
                         lambda text: len(tok.encode(text, add_special_tokens=False)),
                         args.output_len, args.max_model_len, args.seed)


def client_report(runs: list[ClientRun], wall_s: float) -> dict:
    """Each client process's CPU share of one core over its run, and whether one saturated."""
    shares = [r.cpu_s / max(1e-9, r.end_s - r.start_s) for r in runs if r.records]
    return {"num_clients": len(runs), "client_cpu_s": [r.cpu_s for r in runs],
            "client_cpu_fraction": shares, "client_saturated": any(s >= SATURATED_CPU for s in shares)}


def run(args: argparse.Namespace) -> dict:
    """The benchmark (see the module docstring); returns :func:`summarize`'s figures plus the
    client and server CPU reports and the first errors."""
    reqs = load_requests(args)
    if not reqs:
        raise SystemExit(f"error: --dataset {args.dataset}: no usable entry")
    cfg = ClientConfig(url=args.url.rstrip("/"), endpoint=args.endpoint, model=args.model,
                       timeout_s=args.timeout, seed=args.seed)
    pids = [int(x) for x in args.server_pid.split(",")] if args.server_pid else []
    bar = tqdm(total=len(reqs), disable=args.no_progress, desc="requests")

    def progress(done: int) -> None:
        bar.update(done - bar.n)
    server0 = [process_cpu_s(p, gone=None) for p in pids]
    t0 = time.monotonic()
    runs = run_clients(cfg, reqs, args.max_concurrency or len(reqs), args.request_rate,
                       args.num_clients, progress)
    t1 = time.monotonic()
    server1 = [process_cpu_s(p, gone=None) for p in pids]
    bar.close()
    records = [rec for r in runs for rec in r.records]
    active = [r for r in runs if r.records]
    wall = max(r.end_s for r in active) - min(r.start_s for r in active) if active else t1 - t0
    res = summarize(records, wall)
    res.update(client_report(runs, wall))
    if pids:
        res["server_cpu_fraction"] = {str(p): (None if a is None or b is None else (b - a) / (t1 - t0))
                                      for p, a, b in zip(pids, server0, server1)}
    res["errors"] = [r.error for r in records if not r.ok][:5]
    return res


def print_summary(res: dict) -> None:
    print(f"completed {res['completed']}, failed {res['failed']}, {res['duration_s']:.2f} s")
    print(f"request throughput {res['request_throughput']:.2f} req/s, output "
          f"{res['output_throughput']:.1f} tok/s, total {res['total_token_throughput']:.1f} tok/s")
    for m in ("ttft", "tpot", "itl", "e2e"):
        print(f"{m.upper():5s} ms: mean {res[m + '_mean_ms']:.1f}  median {res[m + '_median_ms']:.1f}"
              f"  p99 {res[m + '_p99_ms']:.1f}")
    shares = ", ".join(f"{100 * s:.0f}%" for s in res["client_cpu_fraction"])
    print(f"client CPU ({res['num_clients']} process(es)), share of one core: {shares}")
    if "server_cpu_fraction" in res:
        print("server CPU, share of one core: " + ", ".join(
            f"pid {p}: {'gone' if s is None else f'{100 * s:.0f}%'}"
            for p, s in res["server_cpu_fraction"].items()))
    if res["client_saturated"]:
        print(f"warning: a client process used >= {100 * SATURATED_CPU:.0f}% of a core: the figures "
              "may measure the client, not the server; add --num-clients")
    for err in res["errors"]:
        print(f"error: {err}")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    res = run(args)
    print_summary(res)
    if args.json_out:
        write_result(args.json_out, "serve", res, vars(args), subcommand_line("serve", argv))
    return 1 if res["completed"] == 0 else 0
