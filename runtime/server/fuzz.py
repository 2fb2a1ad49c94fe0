"""``python -m runtime.server.fuzz``: throw random JSON at both generation endpoints of a real engine.

    python -m runtime.server.fuzz --requests 2000 --seed 1 [--json]

The server app runs in this process (``httpx.ASGITransport``) around a real ``AsyncEngine`` (real
worker processes, the default model, PP=2). Each request starts from a valid body of one endpoint
(``max_tokens`` 2, so a request that is served stays cheap) and replaces one to three fields, known or
unknown, half the time with a value of about the right type (:func:`plausible`, often at a boundary)
and otherwise with a random JSON value from :func:`random_json`: huge and boundary integers (2**63,
-1, ...), floats, lone UTF-16 surrogates (sent as raw ``\\udXXX`` JSON escapes), nested lists and
objects. After every request ``/health`` is asked. The run reports how many requests were sent,
how many were answered 5xx (with the first few bodies) and whether the engine survived; the exit
status is 1 when any 5xx was seen or the engine died.

The closing figure of issue 19 comes from this script (docs/server.md, "Error behaviour").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
          "n", "ignore_eos", "stream", "stream_options", "user", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "return_tokens_as_token_ids"]
COMPLETION_FIELDS = FIELDS + ["prompt", "logprobs", "echo", "suffix", "best_of", "prompt_logprobs"]
CHAT_FIELDS = FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                        "add_generation_prompt", "continue_final_message", "chat_template_kwargs"]
INTS = [0, 1, -1, 2, 3, 5, 16, 20, 21, 255, 49151, 49152, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
        2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1, 10**30, -10**30]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -2.5, 1e-300, 1e300, 5e-324, -1e-9, 3.14]
STRINGS = ["", "a", "hi", "\ud800", "x\udfff", "\ud83d", "\ud83d\ude00", "😀", "\x00", "<|im_end|>",
           "<|im_start|>", " " * 3, "default", "token_id:5", "\u202e", "é" * 40]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """One random JSON value (strings may hold lone surrogates; ints may exceed 64 bits)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randrange(-10**6, 10**6)
    if kind == 3:
        return rng.choice(FLOATS) if rng.random() < 0.7 else rng.uniform(-5, 5)
    if kind in (4, 5):
        return rng.choice(STRINGS) if rng.random() < 0.7 else "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xD800, 0xE000),
                            rng.randrange(0x80, 0x3000), rng.randrange(0x1F600, 0x1F650)]))
            for _ in range(rng.randrange(1, 8)))
    if kind in (6, 7):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    keys = ["role", "content", "type", "text", "name", "include_usage", rng.choice(STRINGS)]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def plausible(rng: random.Random, name: str) -> Any:
    """A value of roughly the right type for field ``name`` (often valid, often at a boundary)."""
    if name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        return rng.choice([0.0, 0.5, 1.0, 1.3, 2.0, 2.5, -2.0, 10.0, 1e-6])
    if name in ("stop",):
        return rng.choice([rng.choice(STRINGS), [rng.choice(STRINGS) for _ in range(rng.randrange(1, 6))]])
    if name in ("stop_token_ids", "prompt"):
        return [rng.choice(INTS) for _ in range(rng.randrange(1, 4))]
    if name in ("ignore_eos", "stream", "echo", "return_tokens_as_token_ids", "add_generation_prompt",
                "continue_final_message", "logprobs") and rng.random() < 0.5:
        return rng.choice([True, False])
    if name == "stream_options":
        return {"include_usage": rng.choice([True, False])}
    if name in ("model", "user", "suffix"):
        return rng.choice(STRINGS)
    return rng.choice(INTS[:12])


def random_message(rng: random.Random) -> Any:
    """A chat message that is often nearly valid (so the template and tokenizer are reached)."""
    msg: dict[str, Any] = {"role": rng.choice(["user", "system", "assistant", "developer", "tool"]),
                           "content": random_json(rng) if rng.random() < 0.3 else rng.choice(STRINGS[1:])}
    if rng.random() < 0.3:
        msg["content"] = [{"type": "text", "text": rng.choice(STRINGS)}]
    if rng.random() < 0.2:
        msg["name"] = random_json(rng)
    return msg


def random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(path, body): a valid body with 1-3 fields replaced by random JSON."""
    if rng.random() < 0.5:
        path, fields = "/v1/completions", COMPLETION_FIELDS
        body: dict[str, Any] = {"model": "default", "prompt": "1 2 3 4 5 ", "max_tokens": 2}
    else:
        path, fields = "/v1/chat/completions", CHAT_FIELDS
        body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for _ in range(rng.randrange(1, 4)):
        name = rng.choice(fields + ["bogus"])
        if name == "messages" and rng.random() < 0.7:
            body[name] = [random_message(rng) for _ in range(rng.randrange(1, 4))]
        elif rng.random() < 0.5:
            body[name] = plausible(rng, name)
        else:
            body[name] = random_json(rng)
    return path, body


async def fuzz(num_requests: int, seed: int, pp_size: int, max_model_len: int) -> dict[str, Any]:
    """Send ``num_requests`` random requests; return counts (requests, by status class, 5xx bodies)."""
    import httpx

    from runtime.config import EngineConfig
    from runtime.engine import AsyncEngine
    from runtime.server import create_app

    config = EngineConfig(pp_size=pp_size, max_model_len=max_model_len, max_num_seqs=8,
                          step_timeout_s=120.0)
    engine = await AsyncEngine.start(config)
    app = create_app(engine, config)
    rng = random.Random(seed)
    stats: dict[str, Any] = {"requests": 0, "2xx": 0, "4xx": 0, "5xx": 0, "engine_died_at": None,
                             "examples_5xx": []}
    try:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=300) as client:
            for i in range(num_requests):
                path, body = random_request(rng)
                raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates as \udXXX
                r = await client.post(path, content=raw, headers={"content-type": "application/json"})
                stats["requests"] += 1
                klass = f"{r.status_code // 100}xx"
                stats[klass] = stats.get(klass, 0) + 1
                if r.status_code >= 500 and len(stats["examples_5xx"]) < 5:
                    stats["examples_5xx"].append({"path": path, "body": raw.decode(), "status": r.status_code,
                                                  "answer": r.text[:300]})
                if (await client.get("/health")).status_code != 200:
                    stats["engine_died_at"] = i
                    break
    finally:
        await engine.shutdown()
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.server.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests to send")
    p.add_argument("--seed", type=int, default=0, help="seed of the request generator")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages of the engine")
    p.add_argument("--max-model-len", type=int, default=256, help="tokens per request at most")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    stats = asyncio.run(fuzz(args.requests, args.seed, args.pp, args.max_model_len))
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"requests {stats['requests']}: 2xx {stats['2xx']}, 4xx {stats['4xx']}, 5xx {stats['5xx']}; "
              f"engine {'died after request ' + str(stats['engine_died_at']) if stats['engine_died_at'] is not None else 'alive'}")
        for ex in stats["examples_5xx"]:
            print(f"  5xx: {ex['path']} {ex['body'][:200]} -> {ex['status']} {ex['answer'][:200]}")
    return 1 if stats["5xx"] or stats["engine_died_at"] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
