"""Error paths of both generation endpoints, streamed and not, against a scripted engine.

The engine here replays a fixed list of increments per request, so each case states exactly what
the engine did: fail mid-stream (an increment with ``error`` set) or end its stream without a final
increment (a broken engine must not look like a normal end). Expected: streamed responses carry
the text so far, then one OpenAI error event, then ``[DONE]``; non-streamed ones are HTTP 500.
"""

from __future__ import annotations

import json

import httpx
import pytest

from runtime.config import EngineConfig
from runtime.engine.outputs import RequestOutput
from runtime.server import create_app

CONFIG = EngineConfig(max_model_len=64, pp_size=2)
ENDPOINTS = {"completions": ("/v1/completions", {"prompt": "hi"}),
             "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})}


class _Tokenizer:
    """Byte-level: token id = byte value; chat = the user contents joined."""
    vocab_size, eos_token_id = 256, 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id == self.eos_token_id


class ScriptedEngine:
    """AsyncEngine interface; every request streams ``tokens`` one per increment, then ``ending``:
    ``"error"`` (a final increment with ``error`` set, as when a rank dies) or ``"vanish"`` (the
    stream stops without a final increment)."""

    def __init__(self, tokens: str, ending: str) -> None:
        self.tokenizer, self.model_name, self.config = _Tokenizer(), "scripted", CONFIG
        self.tokens, self.ending = tokens, ending
        self.is_alive = True
        self.requests: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, req_id, prompt_token_ids, params):
        self.requests.append(req_id)
        return self._run(req_id, len(prompt_token_ids))

    async def _run(self, req_id: str, n_prompt: int):
        for n, ch in enumerate(self.tokens, start=1):
            yield RequestOutput(req_id, [ord(ch)], ch, False, None, n_prompt, n)
        if self.ending == "error":
            yield RequestOutput(req_id, [], "", True, "abort", n_prompt, len(self.tokens),
                                error="rank 1 died")

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "steps_total": 0, "generated_tokens_total": 0,
                "rank_busy_seconds": [0.0, 0.0], "bubble_fraction": 0.0, "pp_size": 2}


def _events(body: str) -> list:
    """SSE body -> JSON payloads, ``"[DONE]"`` kept as a string; every block must be ``data:``."""
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _text(endpoint: str, events: list) -> str:
    if endpoint == "chat":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    return "".join(e["choices"][0]["text"] for e in events)


async def _post(engine: ScriptedEngine, endpoint: str, stream: bool) -> httpx.Response:
    path, body = ENDPOINTS[endpoint]
    app = create_app(engine, CONFIG)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json={**body, "max_tokens": 10, "stream": stream})


#: how each ending is reported (docs/server.md): an engine that failed (a rank died) is 503
#: service_unavailable; a stream that ended without a final result is a server bug, 500
STATUS = {"error": (503, "service_unavailable"), "vanish": (500, "internal_server_error")}


def _assert_engine_error(error: dict, cause: str, ending: str) -> None:
    assert error["type"] == STATUS[ending][1] and error["code"] == "engine_error"
    assert cause in error["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("ending,cause", [("error", "rank 1 died"), ("vanish", "without a result")])
async def test_stream_failure_gives_text_then_error_event_then_done(endpoint, ending, cause):
    engine = ScriptedEngine("abc", ending)
    r = await _post(engine, endpoint, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r.text)
    assert ev[-1] == "[DONE]" and "error" in ev[-2], ev
    _assert_engine_error(ev[-2]["error"], cause, ending)
    body = ev[:-2]
    assert all("error" not in e for e in body)
    assert _text(endpoint, body) == "abc"
    finishes = [c["finish_reason"] for e in body for c in e["choices"]]
    assert set(finishes) <= {None}, "a failed stream must not claim a normal finish"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("ending,cause", [("error", "rank 1 died"), ("vanish", "without a result")])
async def test_failure_without_stream_is_an_error_status(endpoint, ending, cause):
    engine = ScriptedEngine("abc", ending)
    r = await _post(engine, endpoint, stream=False)
    assert r.status_code == STATUS[ending][0]
    _assert_engine_error(r.json()["error"], cause, ending)
