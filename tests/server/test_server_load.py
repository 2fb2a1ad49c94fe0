"""The real server under 256 concurrent connections (issue #30, item 1): every request completes.

One ``python -m runtime.serve`` process (PP=1, CPU, the tiny random-weight Llama of
``server_process``) serves 128 streamed and 128 non-streamed completions sent at once over 256
pooled httpx connections, then 32 more on connections of the first wave (keep-alive reuse).
Each must succeed: HTTP 200, a stream ends with ``[DONE]`` after a chunk with ``finish_reason``
``length`` and a usage chunk, a non-streamed body carries usage, and every request got exactly
``max_tokens`` tokens (greedy, EOS ignored). The same server also answers the liveness / readiness
probes and the vLLM-named metrics.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_process import TinyServer, tiny_model_folder

pytestmark = pytest.mark.slow

CONNECTIONS = 256
NEW_TOKENS = 3
REUSED = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = TinyServer(tiny_model_folder(tmp_path_factory.mktemp("tiny")), "--max-num-seqs",
                      str(CONNECTIONS), "--max-model-len", "64", "--max-num-batched-tokens", "4096",
                      "--max-prefill-chunk", "4096")
    try:
        url = proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    yield url
    assert proc.stop() == 0, proc.stderr()


def body(i: int, stream: bool) -> dict:
    b = {"model": "default", "prompt": [3 + i % 400, 5, 7, 11 + i % 97], "max_tokens": NEW_TOKENS,
         "temperature": 0.0, "ignore_eos": True}
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    return b


async def streamed(client: httpx.AsyncClient, i: int) -> dict:
    """One stream's outcome: events, finish reasons, usage, whether it ended with [DONE]."""
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body(i, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return {"done": events[-1:] == ["[DONE]"],
            "finish": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                       and c["choices"][0]["finish_reason"]],
            "usage": [c["usage"] for c in chunks if c.get("usage")],
            "errors": [c for c in chunks if "error" in c]}


async def unary(client: httpx.AsyncClient, i: int) -> dict:
    r = await client.post("/v1/completions", json=body(i, False))
    assert r.status_code == 200, r.text
    return r.json()


async def wave(client: httpx.AsyncClient, n: int) -> tuple[list, list]:
    half = n // 2
    results = await asyncio.gather(*(streamed(client, i) for i in range(half)),
                                   *(unary(client, i) for i in range(half, n)))
    return results[:half], results[half:]


def test_256_concurrent_streamed_and_unary_all_complete(server):
    async def run() -> list:
        limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
        async with httpx.AsyncClient(base_url=server, limits=limits, timeout=120) as client:
            return [await wave(client, CONNECTIONS), await wave(client, REUSED)]

    for streams, unaries in asyncio.run(run()):
        for s in streams:
            assert s["done"] and not s["errors"], s
            assert s["finish"] == ["length"], s
            assert len(s["usage"]) == 1 and s["usage"][0]["completion_tokens"] == NEW_TOKENS, s
            assert s["usage"][0]["prompt_tokens"] == 4, s
        for u in unaries:
            assert u["choices"][0]["finish_reason"] == "length", u
            assert u["usage"] == {"prompt_tokens": 4, "completion_tokens": NEW_TOKENS,
                                  "total_tokens": 4 + NEW_TOKENS}, u
