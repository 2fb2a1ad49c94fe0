"""The load client of ``python -m runtime.bench serve``: aiohttp streams, in one or several processes.

One client process runs its share of the requests on one asyncio loop with an ``aiohttp`` session
(the client ``vllm bench serve`` uses too: it parses a stream with far less CPU per chunk than
httpx): streamed ``/v1/completions``, greedy, EOS ignored, at most ``concurrency`` in flight,
Poisson arrivals at ``rate`` requests/s (``inf``: all at once). Each request's record holds the
arrival time of every chunk with text on ``time.monotonic()``, which is one clock for every process
of the machine, so the records of several client processes merge into one timeline.

:func:`run_clients` spreads the requests over ``num_clients`` processes (request ``i`` to process
``i % num_clients``; concurrency and rate split evenly), starts them together behind a barrier and
returns every record, the run's wall time and each process's CPU seconds (user + system) during
its run, so the caller can tell a saturated client from a saturated server.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import random
import resource
import time
from dataclasses import dataclass, field

import aiohttp

from runtime.bench.datasets import BenchRequest
from runtime.bench.metrics import RequestRecord


@dataclass
class ClientConfig:
    """What every client process needs (picklable)."""
    url: str
    endpoint: str = "/v1/completions"
    model: str = "default"
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class ClientRun:
    """One client process's result (times on ``time.monotonic()``, seconds)."""
    records: list[RequestRecord] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0
    cpu_s: float = 0.0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def request_body(cfg: ClientConfig, req: BenchRequest) -> dict:
    """The completion body of one benchmark request."""
    return {"model": cfg.model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_request(session: aiohttp.ClientSession, cfg: ClientConfig,
                      req: BenchRequest) -> RequestRecord:
    """Stream one completion. Failed (``ok`` False, ``error`` set): a status other than 200, a
    transport error, an error event in the stream, or a stream that ends without ``[DONE]``."""
    rec = RequestRecord(sent_s=time.monotonic(), prompt_tokens=req.prompt_len)
    chunks, done = 0, False
    try:
        async with session.post(cfg.url + cfg.endpoint, json=request_body(cfg, req)) as resp:
            if resp.status != 200:
                rec.ok, rec.error = False, f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].rstrip()
                if payload == b"[DONE]":
                    done = True
                    continue
                data = json.loads(payload)
                if "error" in data:
                    rec.ok, rec.error = False, f"error event: {str(data['error'])[:200]}"
                    continue
                choices = data.get("choices")
                if choices and choices[0].get("text"):
                    rec.chunk_s.append(time.monotonic())
                    chunks += 1
                usage = data.get("usage")
                if usage:
                    rec.output_tokens = int(usage["completion_tokens"])
                    rec.prompt_tokens = int(usage["prompt_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, ValueError) as exc:
        rec.ok, rec.error = False, f"{type(exc).__name__}: {exc}"
    if rec.ok and not done:
        rec.ok, rec.error = False, "the stream ended without [DONE]"
    rec.output_tokens = rec.output_tokens or chunks
    return rec


async def run_requests(cfg: ClientConfig, reqs: list[BenchRequest], concurrency: int, rate: float,
                       seed: int, on_done=None) -> ClientRun:
    """All of ``reqs`` from this process (see the module docstring); ``on_done()`` after each."""
    run = ClientRun()
    if not reqs:
        return run
    sem = asyncio.Semaphore(max(1, concurrency))
    gaps = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def limited(req: BenchRequest) -> RequestRecord:
            async with sem:
                rec = await one_request(session, cfg, req)
            if on_done is not None:
                on_done()
            return rec

        cpu0, run.start_s = _cpu_s(), time.monotonic()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(rate):
                await asyncio.sleep(gaps.expovariate(rate))
        run.records = list(await asyncio.gather(*tasks))
        run.end_s, run.cpu_s = time.monotonic(), _cpu_s() - cpu0
    return run


def _client_main(cfg: ClientConfig, reqs: list[BenchRequest], concurrency: int, rate: float,
                 seed: int, barrier, counter, out) -> None:
    """Body of one client process: wait for the others, run, send the result back."""
    def done() -> None:
        with counter.get_lock():
            counter.value += 1
    barrier.wait()
    out.put(asyncio.run(run_requests(cfg, reqs, concurrency, rate, seed, done)))


def split(n: int, parts: int, k: int) -> int:
    """Part ``k`` of ``n`` split into ``parts`` as evenly as possible."""
    return n // parts + (1 if k < n % parts else 0)


def run_clients(cfg: ClientConfig, reqs: list[BenchRequest], concurrency: int, rate: float,
                num_clients: int, progress=None) -> list[ClientRun]:
    """Run ``reqs`` from ``num_clients`` processes (1: in this process); one :class:`ClientRun`
    per process. ``progress(done)`` is called with the requests finished so far.

    Raises:
        RuntimeError: a client process died without a result.
    """
    if num_clients <= 1:
        count = [0]

        def done() -> None:
            count[0] += 1
            if progress is not None:
                progress(count[0])
        return [asyncio.run(run_requests(cfg, reqs, concurrency, rate, cfg.seed, done))]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    barrier, counter, out = ctx.Barrier(num_clients), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_client_main, daemon=True, args=(
        cfg, reqs[k::num_clients], split(concurrency, num_clients, k), rate / num_clients,
        cfg.seed + k, barrier, counter, out)) for k in range(num_clients)]
    for p in procs:
        p.start()
    runs: list[ClientRun] = []
    while len(runs) < num_clients:
        try:
            runs.append(out.get(timeout=0.5))
        except Exception:  # queue.Empty: nothing yet
            if not any(p.is_alive() for p in procs) and out.empty():
                raise RuntimeError(f"{num_clients - len(runs)} client process(es) died "
                                   "without a result") from None
        if progress is not None:
            progress(counter.value)
    for p in procs:
        p.join(10)
    return runs
