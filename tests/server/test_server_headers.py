"""Malformed kinds of issue #12 item 4 not covered by test_server_validation.py: request headers
(Content-Length, Content-Encoding), raw non-UTF-8 bytes, a body in another charset, negative
temperature / top_p, and ``max_tokens: null`` (served with the default, as OpenAI does)."""

from __future__ import annotations

import json

import pytest

from test_server_api import FakeEngine, client_for

COMP = "/v1/completions"
JSON = {"content-type": "application/json"}
BODY = b'{"prompt": "hi", "max_tokens": 2}'


@pytest.mark.parametrize("content,headers,status,param,code", [
    (BODY, {**JSON, "content-length": "abc"}, 400, "content-length", "invalid_header"),
    (BODY, {**JSON, "content-encoding": "gzip"}, 415, "content-encoding", "unsupported_content_encoding"),
    (b'{"prompt": "\xff\xfe"}', JSON, 400, None, "invalid_json"),
    ('{"prompt": "h\xe9"}'.encode("latin-1"), {"content-type": "application/json; charset=latin-1"},
     400, None, "invalid_json"),
    (b'{"prompt": "hi", "temperature": -0.5}', JSON, 400, "temperature", "invalid_value"),
    (b'{"prompt": "hi", "top_p": -0.1}', JSON, 400, "top_p", "invalid_value"),
    (b'{"prompt": "hi", "max_tokens": true}', JSON, 400, "max_tokens", "invalid_value"),
], ids=["content-length", "content-encoding", "non-utf8", "latin-1", "temperature<0", "top_p<0",
        "max_tokens-bool"])
async def test_malformed_request_is_4xx_naming_the_field(content, headers, status, param, code):
    engine = FakeEngine()
    async with client_for(engine) as c:
        r = await c.post(COMP, content=content, headers=headers)
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["code"]) == (status, param, code)
        if param is not None:
            assert param.split("-")[-1] in err["message"].lower()
        ok = await c.post(COMP, content=BODY, headers=JSON)   # nothing lost: the next one is served
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"
    assert engine.aborted == []


async def test_identity_encoding_and_null_max_tokens_are_served():
    async with client_for(FakeEngine()) as c:
        r = await c.post(COMP, content=BODY, headers={**JSON, "content-encoding": "identity"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        r = await c.post(COMP, json={"prompt": "hi", "max_tokens": None})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 2


def _openai_error(status_message: str, type_: str, param: str | None, code: str) -> bytes:
    """The exact bytes of an OpenAI-style error body as FastAPI's JSONResponse writes it."""
    return json.dumps({"error": {"message": status_message, "type": type_, "param": param,
                                 "code": code}}, separators=(",", ":")).encode()


async def test_413_and_415_bodies_are_byte_for_byte_the_shape_of_every_other_error():
    """The guard middleware answers 413 / 415 before the app: same keys, same compact JSON and
    content type as a 400 the app's handlers write (they were ``", "``-separated before)."""
    async with client_for(FakeEngine()) as c:
        bad = await c.post(COMP, json={"prompt": "hi", "n": 0})
        big = await c.post(COMP, content=b'{"prompt": "' + b"x" * (1 << 20) + b'"}', headers=JSON)
        gz = await c.post(COMP, content=BODY, headers={**JSON, "content-encoding": "gzip"})
    assert bad.status_code == 400 and bad.content == _openai_error(
        "Invalid value for 'n': Input should be greater than or equal to 1",
        "invalid_request_error", "n", "invalid_value")
    assert big.status_code == 413 and big.content == _openai_error(
        "The request body exceeds the limit of 1048576 bytes.", "invalid_request_error", None,
        "request_too_large")
    assert gz.status_code == 415 and gz.content == _openai_error(
        "Unsupported 'Content-Encoding: gzip': send the JSON body uncompressed.",
        "invalid_request_error", "content-encoding", "unsupported_content_encoding")
    for r in (bad, big, gz):
        assert r.headers["content-type"] == "application/json"
        assert int(r.headers["content-length"]) == len(r.content)
