"""The HTTP layer against an in-process fake engine: response shapes, SSE, usage, auth, metrics.

``FakeEngine`` implements the AsyncEngine interface with byte-level "tokens" (id = byte value) and
a fixed reply ``REPLY`` generated one token per ``step_s`` seconds, so every expected value is exact.
The real engine behind a real server is covered by test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import EngineConfig
from runtime.engine import EngineDeadError, RequestRejected
from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.server import create_app

REPLY = "abcdefghijklmnopqrstuvwxyz"
CONFIG = EngineConfig(max_model_len=64, pp_size=2)


class FakeTokenizer:
    """Byte-level tokenizer: token id = byte value; chat = ``<role>content`` ... ``<assistant>``."""
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id == self.eos_token_id

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if continue_final_message:
            return self.encode(text)
        if messages[-1]["role"] == "assistant":
            raise ValueError("chat template render failed: the last message must not be the assistant's")
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class FakeEngine:
    """The AsyncEngine interface over a deterministic generator (one byte of REPLY per step)."""

    def __init__(self, step_s: float = 0.0, fail_after: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.config = CONFIG
        self.step_s = step_s
        self.fail_after = fail_after
        self.is_alive = True
        self.live: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.tokens = 0

    def add_request(self, req_id, prompt_token_ids, params):
        if not self.is_alive:
            raise EngineDeadError("engine is shut down")
        if len(prompt_token_ids) >= self.config.scheduler.max_model_len:
            raise RequestRejected("prompt", "too long")
        self.live[req_id] = asyncio.Event()
        return self._run(req_id, len(prompt_token_ids), params)

    async def _run(self, req_id, n_prompt, params):
        full = (REPLY * 8)[:params.max_tokens]
        hits = [(full.index(s), s) for s in params.stop if s in full]
        last, keep = (len(full), len(full)) if not hits else (min(hits)[0] + len(min(hits)[1]), min(hits)[0])
        stop_ev, done = self.live[req_id], False
        try:
            for n in range(1, last + 1):
                await asyncio.sleep(self.step_s)
                if stop_ev.is_set():
                    done = True
                    yield RequestOutput(req_id, [], "", True, "abort", n_prompt, n - 1)
                    return
                if self.fail_after is not None and n > self.fail_after:
                    done = True
                    yield RequestOutput(req_id, [], "", True, "abort", n_prompt, n - 1, error="rank 1 died")
                    return
                tok = ord(full[n - 1])
                self.steps += 1
                self.tokens += 1
                lps = None if params.logprobs is None else [
                    TokenLogprob(tok, -0.25, dict(list({tok: -0.25, tok + 1: -2.0}.items())[:params.logprobs]))]
                done = n == last
                reason = ("stop" if hits else "length") if done else None
                yield RequestOutput(req_id, [tok], chr(tok) if n <= keep else "", done, reason, n_prompt, n, lps)
        finally:
            if not done:  # like the real engine: a stream closed early aborts its request
                await self.abort(req_id)
            self.live.pop(req_id, None)

    async def abort(self, req_id: str) -> None:
        if req_id in self.live and not self.live[req_id].is_set():
            self.aborted.append(req_id)
            self.live[req_id].set()

    def stats(self) -> dict:
        return {"num_running": len(self.live), "num_waiting": 0, "steps_total": self.steps,
                "generated_tokens_total": self.tokens, "rank_busy_seconds": [1.5, 0.5],
                "bubble_fraction": 0.25, "pp_size": 2}


def client_for(engine: FakeEngine, **kw) -> httpx.AsyncClient:
    app = create_app(engine, CONFIG, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(body: str) -> list:
    """Parse an SSE body into JSON payloads (``"[DONE]"`` kept as a string)."""
    assert body.endswith("data: [DONE]\n\n")
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: ")
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_models_and_health():
    async with client_for(FakeEngine()) as c:
        r = await c.get("/v1/models")
        assert r.status_code == 200
        data = r.json()["data"]
        assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [("fake-model", "model", 64)]
        assert (await c.get("/v1/models/default")).json()["id"] == "fake-model"
        assert (await c.get("/health")).json() == {"status": "ok"}


async def test_completion_exact_text_and_usage():
    async with client_for(FakeEngine()) as c:
        r = await c.post("/v1/completions", json={"model": "default", "prompt": "hello", "max_tokens": 5})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "fake-model"
        assert body["choices"] == [{"index": 0, "text": "abcde", "logprobs": None, "finish_reason": "length"}]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_stream_with_usage_and_stop():
    async with client_for(FakeEngine()) as c:
        r = await c.post("/v1/completions", json={
            "model": "fake-model", "prompt": [104, 105], "max_tokens": 10, "stop": ["de"],
            "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = sse_events(r.text)
        assert ev[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == "abc"
        assert [e["choices"][0]["finish_reason"] for e in ev[:-2]] == [None, None, None, "stop"]
        assert ev[-2]["choices"] == [] and ev[-2]["usage"] == {
            "prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_nonstream_and_stream():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    prompt_len = len("<system>s<user>hi<assistant>")
    async with client_for(FakeEngine()) as c:
        r = await c.post("/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": 3})
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3,
                                 "total_tokens": prompt_len + 3,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 2,
                                                        "stream": True})
        ev = sse_events(r.text)
        assert [e["choices"][0]["delta"] for e in ev[:-1]] == [
            {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {}]
        assert [e["choices"][0]["finish_reason"] for e in ev[:-1]] == [None, None, None, "length"]
        assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])


async def test_chat_template_rejection_is_400():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    async with client_for(FakeEngine()) as c:
        r = await c.post("/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Invalid value for 'messages': chat template render failed: the last message must "
                       "not be the assistant's", "type": "invalid_request_error", "param": "messages",
            "code": "invalid_value"}


async def test_chat_default_max_tokens_fills_context():
    msgs = [{"role": "user", "content": "x"}]
    prompt_len = len("<user>x<assistant>")
    async with client_for(FakeEngine()) as c:
        body = (await c.post("/v1/chat/completions", json={"messages": msgs})).json()
        assert body["usage"]["completion_tokens"] == 64 - prompt_len
        assert body["choices"][0]["finish_reason"] == "length"


async def test_logprobs_completion_and_chat():
    async with client_for(FakeEngine()) as c:
        body = (await c.post("/v1/completions", json={
            "prompt": "p", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True})).json()
        assert body["choices"][0]["logprobs"] == {
            "tokens": ["token_id:97", "token_id:98"], "token_logprobs": [-0.25, -0.25],
            "top_logprobs": [{"token_id:97": -0.25}, {"token_id:98": -0.25}], "text_offset": [0, 1]}
        body = (await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 2})).json()
        assert body["choices"][0]["logprobs"] == {"content": [{
            "token": "a", "logprob": -0.25, "bytes": [97],
            "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]},
                             {"token": "b", "logprob": -2.0, "bytes": [98]}]}]}


async def test_api_key():
    async with client_for(FakeEngine(), api_key="sk-test") as c:
        req = {"prompt": "p", "max_tokens": 1}
        r = await c.post("/v1/completions", json=req)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/completions", json=req, headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
        r = await c.post("/v1/completions", json=req, headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_engine_failure_mid_request():
    async with client_for(FakeEngine(fail_after=2)) as c:
        r = await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 5})
        assert r.status_code == 503  # the engine is down (a worker died): retry later
        assert r.json()["error"] == {"message": "The engine failed while generating: rank 1 died",
                                     "type": "service_unavailable", "param": None,
                                     "code": "engine_error"}
        r = await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 5, "stream": True})
        ev = sse_events(r.text)
        assert [e["choices"][0]["text"] for e in ev[:2]] == ["a", "b"]
        assert ev[2]["error"]["code"] == "engine_error" and ev[3] == "[DONE]"


async def test_dead_engine_is_503():
    engine = FakeEngine()
    engine.is_alive = False
    async with client_for(engine) as c:
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/completions", json={"prompt": "p"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


async def test_metrics_series():
    engine = FakeEngine()
    async with client_for(engine) as c:
        await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
        await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 0})
        text = (await c.get("/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("ppstate_time_to_first_token_seconds_count", ())] == 1
    assert samples[("ppstate_inter_token_latency_seconds_count", ())] == 2
    assert samples[("ppstate_time_per_output_token_seconds_count", ())] == 1
    assert samples[("ppstate_e2e_request_latency_seconds_count", ())] == 1
    assert samples[("ppstate_requests_finished_total", (("finish_reason", "length"),))] == 1
    assert samples[("ppstate_prompt_tokens_total", ())] == 1
    assert samples[("ppstate_request_errors_total", (("status", "400"),))] == 1
    assert samples[("ppstate_num_requests_running", ())] == 0
    assert samples[("ppstate_num_requests_waiting", ())] == 0
    assert samples[("ppstate_engine_steps_total", ())] == 3
    assert samples[("ppstate_generation_tokens_total", ())] == 3
    assert samples[("ppstate_rank_busy_seconds_total", (("rank", "1"),))] == 0.5
    assert samples[("ppstate_pipeline_bubble_fraction", ())] == 0.25
    assert samples[("ppstate_engine_alive", ())] == 1
