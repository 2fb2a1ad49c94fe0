"""Invalid requests -> HTTP 400 with an OpenAI error naming the field; disconnects abort requests.

``malformed_cases`` is shared with test_server_e2e.py, which replays it against the real server.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.server import create_app
from test_server_api import CONFIG, FakeEngine, client_for

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
STEPS_AFTER_DISCONNECT = 1  # at most the engine step already under way when the disconnect arrives


def malformed_cases(max_model_len: int) -> list[tuple[str, object, str | None, str]]:
    """(path, JSON body or raw bytes, expected param, expected code) for invalid requests."""
    long_prompt = "hello " * (max_model_len + 8)
    return [
        (COMP, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
        (COMP, {"prompt": "hi", "max_tokens": -3}, "max_tokens", "invalid_value"),
        (COMP, {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "invalid_value"),
        (COMP, {"prompt": "hi", "max_tokens": 5.5}, "max_tokens", "invalid_value"),
        (COMP, {"prompt": "hi", "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
        (COMP, {"prompt": "hi", "temperature": 2.5}, "temperature", "invalid_value"),
        (COMP, {"prompt": "hi", "temperature": "hot"}, "temperature", "invalid_value"),
        (COMP, {"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
        (COMP, {"prompt": "hi", "top_p": 1.5}, "top_p", "invalid_value"),
        (COMP, {"prompt": "hi", "top_k": -2}, "top_k", "invalid_value"),
        (COMP, {"prompt": "hi", "n": 0}, "n", "invalid_value"),
        (COMP, {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "invalid_value"),
        (COMP, {"prompt": "hi", "seed": -2}, "seed", "invalid_value"),
        (COMP, {"prompt": "hi", "seed": 2**63}, "seed", "invalid_value"),
        (COMP, {"prompt": "hi", "top_k": 1.5}, "top_k", "invalid_value"),
        (COMP, {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids", "invalid_value"),
        (COMP, {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids", "invalid_value"),
        (COMP, {"prompt": [1, 2**63]}, "prompt", "invalid_value"),
        (COMP, {"prompt": "hi", "max_tokens": 2**64}, "max_tokens", "context_length_exceeded"),
        (COMP, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        (COMP, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        (COMP, {"prompt": "hi", "repetition_penalty": 10.5}, "repetition_penalty", "invalid_value"),
        (COMP, {"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "invalid_value"),
        (COMP, {"prompt": "hi", "logit_bias": {"5": -100.5}}, "logit_bias", "invalid_value"),
        (COMP, {"prompt": "hi", "suffix": "x"}, "suffix", "invalid_value"),
        # lone UTF-16 surrogates (raw JSON escapes) in every kind of string field
        (COMP, b'{"prompt": "Hi \\ud800 there", "max_tokens": 2}', "prompt", "invalid_value"),
        (COMP, b'{"prompt": ["\\udfff"]}', "prompt[0]", "invalid_value"),
        (COMP, b'{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop[1]", "invalid_value"),
        (COMP, b'{"prompt": "hi", "user": "\\udc00"}', "user", "invalid_value"),
        (COMP, b'{"prompt": "hi", "model": "\\ud800"}', "model", "invalid_value"),
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content",
         "invalid_value"),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
         "messages[0].content[0].text", "invalid_value"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi", "name": "\\udfff"}]}',
         "messages[0].name", "invalid_value"),
        (COMP, b'{"prompt": "hi", "temperature": NaN}', None, "invalid_json"),
        (COMP, b'{"prompt": "hi", "top_p": 1e400}', None, "invalid_json"),
        (CHAT, {"messages": USER + [{"role": "assistant", "content": "Sure"}], "continue_final_message": True},
         "continue_final_message", "invalid_value"),
        (CHAT, {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
         "continue_final_message", "invalid_value"),
        (CHAT, {"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt", "invalid_value"),
        (COMP, {"prompt": "hi", "stop": 7}, "stop", "invalid_value"),
        (COMP, {"prompt": "hi", "stop": ["a", ""]}, "stop", "invalid_value"),
        (COMP, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        (COMP, {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos", "invalid_value"),
        (COMP, {"prompt": "hi", "stream": "true"}, "stream", "invalid_value"),
        (COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        (COMP, {"prompt": "hi", "logprobs": 6}, "logprobs", "invalid_value"),
        (COMP, {"prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty", "invalid_value"),
        (COMP, {"prompt": "hi", "bogus": 1}, "bogus", "unknown_parameter"),
        (COMP, {"prompt": "hi", "model": "gpt-4"}, "model", "model_not_found"),
        (COMP, {"max_tokens": 5}, "prompt", "missing_required_parameter"),
        (COMP, {"prompt": ""}, "prompt", "invalid_value"),
        (COMP, {"prompt": 42}, "prompt", "invalid_value"),
        (COMP, {"prompt": ["a", ""]}, "prompt", "invalid_value"),
        (CHAT, {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs", "invalid_value"),
        (COMP, {"prompt": [1, "a"]}, "prompt", "invalid_value"),   # neither ids nor a batch
        (COMP, {"prompt": [1, 2, 999999]}, "prompt", "invalid_value"),
        (COMP, {"prompt": long_prompt}, "prompt", "context_length_exceeded"),
        (CHAT, {"messages": []}, "messages", "invalid_value"),
        (CHAT, {"messages": "hello"}, "messages", "invalid_value"),
        (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
        (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs", "invalid_value"),
        (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        (CHAT, {"messages": USER, "model": "nope"}, "model", "model_not_found"),
        (CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage", "invalid_value"),
        (CHAT, {"messages": [{"role": "user", "content": long_prompt}]}, "messages", "context_length_exceeded"),
        (CHAT, b"{not json", None, "invalid_json"),
        (CHAT, b"[1, 2]", None, "invalid_body"),
        (COMP, b"", None, "invalid_body"),
    ]


def check_error(status: int, body: dict, param: str | None, code: str) -> None:
    """Assert an OpenAI-style 400 naming ``param``."""
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert err["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"], err["message"]


@pytest.mark.parametrize("case", malformed_cases(CONFIG.scheduler.max_model_len), ids=lambda c: str(c[2]))
async def test_malformed_request_is_400(case):
    path, body, param, code = case
    async with client_for(FakeEngine()) as c:
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, json=body)
        check_error(r.status_code, r.json(), param, code)
        ok = await c.post(COMP, json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"


async def test_oversized_body_is_413_and_server_keeps_serving():
    body = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    async with client_for(FakeEngine()) as c:
        r = await c.post(COMP, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["code"], err["type"], err["param"]) == ("request_too_large", "invalid_request_error", None)
        assert str(1 << 20) in err["message"]
        ok = await c.post(COMP, json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"


async def test_form_content_type_is_parsed_as_json():
    async with client_for(FakeEngine()) as c:
        r = await c.post(COMP, content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                         headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a"


async def test_unknown_route_and_method():
    async with client_for(FakeEngine()) as c:
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await c.get(COMP)
        assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


async def _drive_asgi(app, body: dict, disconnect_after_chunks: int | None, engine: FakeEngine,
                      disconnect_after_steps: int, at_disconnect: list[int]):
    """Run one POST through the ASGI app; the client disconnects after some body chunks (stream)
    or once the engine ran some steps (non-stream); ``at_disconnect`` gets the engine's step count
    at that moment."""
    sent: list[dict] = []
    chunk_seen = asyncio.Event()
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if disconnect_after_chunks is not None:
            while sum(1 for m in sent if m["type"] == "http.response.body") < disconnect_after_chunks:
                chunk_seen.clear()
                await chunk_seen.wait()
        else:
            while engine.steps < disconnect_after_steps:
                await asyncio.sleep(0)  # yield to the engine: one loop turn, no wall-clock wait
        at_disconnect.append(engine.steps)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunk_seen.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": COMP, "raw_path": COMP.encode(),
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "root_path": ""}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_request(stream):
    engine = FakeEngine(step_s=0.0)
    app = create_app(engine, CONFIG)
    body = {"prompt": "hi", "max_tokens": 60, "stream": stream}
    at_disconnect: list[int] = []
    sent = await _drive_asgi(app, body, 3 if stream else None, engine, 3, at_disconnect)
    assert len(engine.aborted) == 1 and engine.live == {}
    assert engine.stats()["num_running"] == 0
    if stream:
        assert sent[0]["status"] == 200 and b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    # counted in engine steps: the abort lands within STEPS_AFTER_DISCONNECT steps of the disconnect
    assert at_disconnect[0] >= 2 and engine.steps <= at_disconnect[0] + STEPS_AFTER_DISCONNECT
