"""``python -m runtime.bench serve``: load an OpenAI-compatible server, like ``vllm bench serve``.

Sends ``--num-prompts`` streamed ``/v1/completions`` requests with random-token prompts of
``--input-len`` tokens and ``--output-len`` new tokens (greedy, EOS ignored), at most
``--max-concurrency`` at once, arriving as a Poisson process of ``--request-rate`` requests/s
(``inf``: all at once). Reports request throughput, output and total tokens/s and TTFT / TPOT /
ITL / E2E mean, median, p90, p99 (:mod:`runtime.bench.metrics`), with a progress bar; ``--json-out
F`` writes them with date, machine and command (:mod:`runtime.bench.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

import httpx
from tqdm.asyncio import tqdm

from runtime.bench.metrics import RequestRecord, summarize
from runtime.bench.results import subcommand_line, write_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench serve", description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default="default", help="model name sent in each request")
    p.add_argument("--dataset", choices=["random"], default="random",
                   help="random: prompts of random token ids (ids 100..39999)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals); inf: send all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through ``p.error`` naming the flag of the first bad value."""
    for flag in ("input_len", "output_len", "num_prompts"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (100..39999), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace,
                      prompt: list[int]) -> RequestRecord:
    """Stream one completion; the record holds the arrival time of every chunk with text."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    rec = RequestRecord(sent_s=time.perf_counter(), prompt_tokens=len(prompt))
    chunks = 0
    try:
        async with client.stream("POST", args.endpoint, json=body, timeout=args.timeout) as resp:
            if resp.status_code != 200:
                rec.ok, rec.error = False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("choices") and data["choices"][0].get("text"):
                    rec.chunk_s.append(time.perf_counter())
                    chunks += 1
                if data.get("usage"):
                    rec.output_tokens = int(data["usage"]["completion_tokens"])
                    rec.prompt_tokens = int(data["usage"]["prompt_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        rec.ok, rec.error = False, f"{type(exc).__name__}: {exc}"
    rec.output_tokens = rec.output_tokens or chunks
    return rec


async def benchmark(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """Run the benchmark against ``client`` (base URL set); returns :func:`summarize`'s dict plus
    the first errors."""
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    gaps = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    bar = tqdm(total=len(prompts), disable=args.no_progress, desc="requests")

    async def limited(prompt: list[int]) -> RequestRecord:
        async with sem:
            rec = await one_request(client, args, prompt)
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(gaps.expovariate(args.request_rate))
    records = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    bar.close()
    res = summarize(records, wall)
    res["errors"] = [r.error for r in records if not r.ok][:5]
    return res


def print_summary(res: dict) -> None:
    print(f"completed {res['completed']}, failed {res['failed']}, {res['duration_s']:.2f} s")
    print(f"request throughput {res['request_throughput']:.2f} req/s, output "
          f"{res['output_throughput']:.1f} tok/s, total {res['total_token_throughput']:.1f} tok/s")
    for m in ("ttft", "tpot", "itl", "e2e"):
        print(f"{m.upper():5s} ms: mean {res[m + '_mean_ms']:.1f}  median {res[m + '_median_ms']:.1f}"
              f"  p99 {res[m + '_p99_ms']:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)

    async def go() -> dict:
        limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
        async with httpx.AsyncClient(base_url=args.url, limits=limits) as client:
            return await benchmark(client, args)
    res = asyncio.run(go())
    print_summary(res)
    if args.json_out:
        write_result(args.json_out, "serve", res, vars(args), subcommand_line("serve", argv))
    return 1 if res["completed"] == 0 else 0
