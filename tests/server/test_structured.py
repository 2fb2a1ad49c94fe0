"""Structured outputs and tool calling through the real server (``python -m runtime.serve``) with
the ``openai`` client.

Two servers of a tiny random-weight Llama with the embedded model's real tokenizer and the
built-in ``hermes`` chat template (tests/helpers/tiny_chat_model.py), started together: PP=2
overlapped with ``--spec-tokens 2`` and a KV cache small enough that concurrent requests are
preempted and recomputed (the grammar matcher is rebuilt from the output tokens), and PP=1
without drafts. A random model is the hard case for a grammar: it never "wants" valid JSON, so
every valid output is the mask's doing. The schemas are bounded (runtime/bench/json_schemas.py) so
each output completes within ``max_tokens``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from runtime.bench.json_schemas import close_json_prefix, schemas
from tiny_chat_model import make_tiny_chat_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = schemas(56, seed=31)
MAX_TOKENS = 224   # the longest output of the 56 schemas from this random model is ~120 tokens
MSG = [{"role": "user", "content": "Answer in JSON."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 6},
                                          "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"]}}},
]


class Server:
    """``python -m runtime.serve --port 0 FLAGS`` (URL read from its ``ready:`` line)."""

    def __init__(self, *flags: str) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--port", "0", *flags],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = re.match(r"ready: (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self.ready.set()

    def wait(self, timeout: float = 300) -> str:
        if not self.ready.wait(timeout):
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"server not ready: {self.log.read()[-3000:]}")
        return self.url

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    common = ("--model", str(model), "--max-model-len", "512", "--max-num-seqs", "16",
              "--chat-template", "hermes")
    procs = {"pp2-spec-preempt": Server(*common, "--pp", "2", "--spec-tokens", "2",
                                        "--kv-cache-memory", "128KB"),
             "pp1": Server(*common, "--pp", "1")}
    try:
        urls = {k: p.wait() for k, p in procs.items()}
    except BaseException:
        for p in procs.values():
            p.stop()
        raise
    yield {k: openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=120)
           for k, u in urls.items()} | {"urls": urls}
    for p in procs.values():        # both shut down at once
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGINT)
    for p in procs.values():
        assert p.proc.wait(60) == 0


def _clients(servers):
    return [servers["pp2-spec-preempt"], servers["pp1"]]


def _schema_reply(client, i: int, schema: dict) -> tuple[int, str, str]:
    kw = {"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}
    r = client.chat.completions.create(
        model="default", messages=MSG, max_tokens=MAX_TOKENS, **kw,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    return i, r.choices[0].message.content, r.choices[0].finish_reason


def test_generated_schemas_validate_under_pp_spec_and_preemption(servers):
    """56 generated schemas, half on each server, 16 at a time: every output parses and
    validates; the PP=2 server preempted (its KV cache, 32 blocks a rank, holds a fraction of
    the load). An unconstrained 400-token request (``ignore_eos``) runs on the PP=2 server
    throughout, so preemption does not hang on how many constrained requests happen to overlap
    (on a loaded machine their grammar compiles spread them out)."""
    clients = _clients(servers)
    with ThreadPoolExecutor(33) as pool:
        hog = pool.submit(lambda: clients[0].completions.create(
            model="default", prompt="Count:", max_tokens=400, temperature=0,
            extra_body={"ignore_eos": True}).choices[0])
        done = list(pool.map(lambda i: _schema_reply(clients[i % 2], i, SCHEMAS[i]), range(len(SCHEMAS))))
        hog = hog.result()
    assert hog.finish_reason == "length"
    for i, text, finish in done:
        assert finish == "stop", (i, text, SCHEMAS[i])
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    metrics = httpx.get(servers["urls"]["pp2-spec-preempt"] + "/metrics").text
    preempted = float(re.search(r"^ppstate_num_preemptions(?:_total)? (\S+)$", metrics, re.M).group(1))
    assert preempted > 0


@pytest.mark.parametrize("server", ["pp2-spec-preempt", "pp1"])
def test_json_object_regex_choice_and_grammar(servers, server):
    c = servers[server]
    # json_object is unbounded (a random model never closes its first string): the output is a
    # JSON object, or, when cut by max_tokens, a prefix of one
    r = c.chat.completions.create(model="default", messages=MSG, max_tokens=24, temperature=0,
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    full = text if r.choices[0].finish_reason == "stop" else close_json_prefix(text)
    assert isinstance(json.loads(full), dict), text
    r = c.completions.create(model="default", prompt="Code:", max_tokens=20, temperature=0.8, seed=1,
                             extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe not"]
    for seed in range(3):
        r = c.completions.create(model="default", prompt="?", max_tokens=10, temperature=1.0, seed=seed,
                                 extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices
    r = c.chat.completions.create(model="default", messages=MSG, max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "a" [0-9] "z"'}})
    assert re.fullmatch(r"a[0-9]z", r.choices[0].message.content)


def _reassemble(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [{"name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("server", ["pp2-spec-preempt", "pp1"])
def test_constrained_tool_calls_parse_and_stream_alike(servers, server, choice):
    c = servers[server]
    kw = dict(model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0)
    r = c.chat.completions.create(**kw)
    calls = _calls(r.choices[0].message)
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]])
    if choice != "required":
        assert [x["name"] for x in calls] == ["add"]
    content, streamed, finish = _reassemble(c.chat.completions.create(**kw, stream=True))
    assert (content, streamed, finish) == ("", calls, "tool_calls")


def test_auto_tool_call_in_hermes_format_is_parsed(servers):
    """``auto``: the model's own text is parsed; a regex makes this random model write a Hermes
    block (text before it stays content), streamed deltas equal the whole reply."""
    c = servers["pp1"]
    kw = dict(model="default", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
              tool_choice="auto", max_tokens=60, temperature=0,
              extra_body={"guided_regex": r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": '
                                          r'\{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'})
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Sure."
    [call] = _calls(m)
    assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}
    content, streamed, finish = _reassemble(c.chat.completions.create(**kw, stream=True))
    assert (content, streamed, finish) == ("Sure.", [call], "tool_calls")
    # the tools reached the template: the prompt holds their signatures
    plain = c.chat.completions.create(**{**kw, "tools": None, "tool_choice": None, "extra_body": {},
                                         "max_tokens": 1})
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_history_with_tool_calls_and_tool_messages(servers):
    c = servers["pp1"]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"}]
    r = c.chat.completions.create(model="default", messages=history, tools=TOOLS, max_tokens=4,
                                  temperature=0)
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"guided_regex": "(("}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_choice": []}, "guided_choice", "choices"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one"),
]


@pytest.mark.parametrize("extra,param,word", BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_400_naming_the_field(servers, extra, param, word):
    body = {"model": "default", "messages": MSG, "max_tokens": 4, **extra}
    r = httpx.post(servers["urls"]["pp1"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


def test_abort_mid_stream_leaves_the_slot_unconstrained(servers):
    """A constrained stream closed after a few chunks, then (one slot: requests reuse it) an
    unconstrained request and a request with another grammar: each gets only its own rules."""
    c = servers["pp1"]
    s = c.chat.completions.create(model="default", messages=MSG, max_tokens=200, temperature=0,
                                  stream=True, extra_body={"guided_regex": "(ab)+"})
    for n, _ in enumerate(s):
        if n == 3:
            break
    s.close()
    free = c.completions.create(model="default", prompt="x", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    assert not re.fullmatch(r"(ab)+", free.choices[0].text)
    r = c.completions.create(model="default", prompt="x", max_tokens=12, temperature=0,
                             extra_body={"guided_regex": "[xy]{4}"})
    assert re.fullmatch("[xy]{4}", r.choices[0].text)
