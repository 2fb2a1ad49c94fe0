"""``python -m runtime.bench keepalive``: the keep-alive race between a server and a pooled client.

A pooled HTTP client (httpx, aiohttp) reuses an idle connection for up to 5 s; uvicorn closes an
idle keep-alive connection after ``timeout_keep_alive`` seconds (5 s unless told otherwise). When
the two are equal, a request the client sends on a connection that has been idle for just under
5 s can meet the server's close: the server's timer fires in the same event-loop iteration in
which the request's bytes arrive (a busy loop makes that window as long as one iteration), the
server closes the socket with the request unread, and the client sees ``ReadError`` (connection
reset) or ``RemoteProtocolError`` ("Server disconnected without sending a response").

This probe makes that situation on purpose: ``--probes`` clients, each with a pool of exactly one
connection, send a short non-streamed completion, stay idle for a time drawn uniformly from
``[--idle-min, --idle-max]`` seconds, and send again, ``--rounds`` times; meanwhile
``--background`` streamed requests keep the server's event loop busy, as under load, and
``--client-busy-ms`` blocks the probe's own event loop in slices of that many milliseconds (a
saturated client, as a single-process load generator at concurrency 256 is): the client then
releases a finished connection, and starts its idle clock, some milliseconds after the server
started its own, so a reuse that is idle < 5 s for the client can be >= 5 s for the server. It
counts failures by exception type; a failure here is a request sent on a reused connection that
the server closed without answering it (a reset: ``ReadError``).

Exit status 1 when any probe request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time

import httpx

from runtime.bench.results import subcommand_line, write_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench keepalive", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--probes", type=int, default=64, help="clients of one pooled connection each")
    p.add_argument("--rounds", type=int, default=4, help="idle-then-reuse rounds per probe")
    p.add_argument("--idle-min", type=float, default=4.80, help="shortest idle time (s)")
    p.add_argument("--idle-max", type=float, default=4.999, help="longest idle time (s); keep it "
                   "under the client's 5 s pool expiry so the connection is reused")
    p.add_argument("--background", type=int, default=32,
                   help="streamed requests kept running meanwhile (server load)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens per probe request")
    p.add_argument("--client-busy-ms", type=float, default=0.0,
                   help="block the client's event loop in slices of this many ms (a saturated client)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p


def completion_body(max_tokens: int, stream: bool) -> dict:
    """A greedy completion of a fixed token-id prompt (works with any vocabulary >= 8 ids)."""
    body = {"model": "default", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    if stream:
        body["stream"] = True
    return body


async def probe(url: str, args: argparse.Namespace, rng: random.Random, errors: collections.Counter,
                stats: dict) -> None:
    """One client with one pooled connection (httpx's default 5 s keep-alive expiry)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=5.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        for i in range(args.rounds + 1):
            try:
                r = await client.post("/v1/completions", json=completion_body(args.max_tokens, False))
                stats["ok" if r.status_code == 200 else f"http_{r.status_code}"] += 1
            except httpx.HTTPError as exc:
                errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
                stats["failed"] += 1
            if i < args.rounds:
                await asyncio.sleep(rng.uniform(args.idle_min, args.idle_max))


async def background(url: str, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """Streamed requests back to back until ``stop``; returns how many completed."""
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", "/v1/completions",
                                         json=completion_body(32, True)) as resp:
                    async for _ in resp.aiter_lines():
                        pass
                done += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.1)
    return done


async def busy_loop(slice_ms: float, stop: asyncio.Event) -> None:
    """Keep this process's event loop busy: spin ``slice_ms``, yield once, repeat."""
    while not stop.is_set():
        end = time.perf_counter() + slice_ms / 1000.0
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


async def run(args: argparse.Namespace) -> dict:
    """The probe against ``args.url``; returns counts (see the module docstring)."""
    rng = random.Random(args.seed)
    errors: collections.Counter = collections.Counter()
    stats: collections.Counter = collections.Counter()
    stop = asyncio.Event()
    bg = [asyncio.create_task(background(args.url, args, stop)) for _ in range(args.background)]
    busy = (asyncio.create_task(busy_loop(args.client_busy_ms, stop))
            if args.client_busy_ms > 0 else None)
    t0 = time.perf_counter()
    await asyncio.gather(*(probe(args.url, args, random.Random(rng.random()), errors, stats)
                           for _ in range(args.probes)))
    wall = time.perf_counter() - t0
    stop.set()
    bg_done = sum(await asyncio.gather(*bg))
    if busy is not None:
        await busy
    return {"probe_requests": args.probes * (args.rounds + 1), "reused_after_idle":
            args.probes * args.rounds, "ok": stats["ok"], "failed": stats["failed"],
            "other_status": {k: v for k, v in stats.items() if k.startswith("http_")},
            "errors": dict(errors.most_common(5)), "background_completed": bg_done,
            "idle_s": [args.idle_min, args.idle_max], "client_busy_ms": args.client_busy_ms,
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=1))
    if args.json_out:
        write_result(args.json_out, "keepalive", res, vars(args), subcommand_line("keepalive", argv))
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
