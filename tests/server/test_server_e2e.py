"""The real server (``python -m runtime.serve``, default model, PP=2 over gloo) as a subprocess.

One server start per module (~45 s on the 2-core machine); the transformers reference loads while
the server starts. Greedy outputs are compared as token ids: the server returns them through
logprobs with vLLM's ``return_tokens_as_token_ids`` extension, so the comparison is exact.

The same start checks issue #12's process behaviour (item 5 and the /health-while-loading bug):
``/health`` is 503 ``loading`` before the model is up, and the last test stops the server with
SIGTERM while a stream is open: the stream ends with an error event naming the shutdown and
``[DONE]``, the server exits 0 and leaves no worker process and no ipc socket file behind.
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
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reference import greedy_reference, hf_model
from runtime.server.chat_tools import NO_TOOL_TEMPLATE
from test_server_validation import check_error, malformed_cases
from procs import alive, descendants, parents

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
READY_TIMEOUT_S = 300
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name a primary color."}]
NEW_TOKENS = 12
LONG_TOKENS = 48
IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


class ServerProcess:
    """``python -m runtime.serve --port 0`` with its URL parsed from the ``ready:`` line."""

    def __init__(self, *flags: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ppstate-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.serve", "--port", "0", *flags], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.first_line = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.loading_health: tuple[int, dict] | None = None  # GET /health right after line 1

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.first_line.set()
            if line.startswith("ready: "):
                self.ready.set()
        self.first_line.set()

    def check_health_while_loading(self, timeout: float) -> None:
        """GET /health at the URL the first line ("loading model ...") names, before ready."""
        assert self.first_line.wait(timeout) and self.lines, "the server printed nothing"
        first = self.lines[0]
        assert first.startswith("loading model") and "/health answers 503" in first, first
        url = first.split(" stage(s) (")[1].split("; ")[1].split("/health")[0]
        r = httpx.get(f"{url}/health", timeout=60)       # the model is still loading
        self.loading_health = (r.status_code, r.json())

    def wait_ready(self, timeout: float) -> str:
        if not self.ready.wait(timeout):
            self.stop()
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise RuntimeError(f"server not ready in {timeout} s: {''.join(self.lines)}\n{tail}")
        line = next(x for x in self.lines if x.startswith("ready: "))
        return re.match(r"ready: (http://\S+)", line).group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def served():
    """The module's server process, ready (``.url``); stopped with SIGINT at the end unless the
    last test stopped it already."""
    proc = ServerProcess("--pp", "2", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8")
    try:
        proc.check_health_while_loading(READY_TIMEOUT_S)
        hf_model()  # load the reference while the server starts
        proc.url = proc.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0  # clean shutdown of server and workers


@pytest.fixture(scope="module")
def server(served) -> str:
    return served.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def reference_ids(prompt) -> list[int]:
    """Prompt token ids from transformers' own tokenizer (text or chat messages)."""
    _, tok = hf_model()
    if isinstance(prompt, str):
        return list(tok(prompt)["input_ids"])
    enc = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def as_ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metric_samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_health_is_503_loading_before_the_model_is_up(served):
    status, body = served.loading_health
    assert status == 503 and body["status"] == "loading"


def test_startup_names_the_cpu_path_once(served):
    """``runtime.serve`` defaults to the CPU fast path; rank 0 (of 2) says so on stderr, once."""
    log = Path(served.log.name).read_text()   # not through the shared handle: its offset is the server's
    lines = [x for x in log.splitlines() if x.startswith("CPU path: ")]
    assert lines == ["CPU path: fast (ONNX Runtime MatMulNBits: 8-bit weight blocks, int8 activations)"]


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].max_model_len == MAX_MODEL_LEN


def test_completion_greedy_matches_reference(client):
    prompt_ids = reference_ids(PROMPT)
    ref = list(greedy_reference(tuple(prompt_ids), NEW_TOKENS))
    _, tok = hf_model()
    served_name = client.models.list().data[0].id
    r = client.completions.create(model=served_name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                  logprobs=0, extra_body=IDS)
    assert as_ids(r.choices[0].logprobs.tokens) == ref
    assert r.choices[0].text == tok.decode(ref)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt_ids), NEW_TOKENS, len(prompt_ids) + NEW_TOKENS)
    chunks = list(client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(ref)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_chat_greedy_matches_reference(client):
    prompt_ids = reference_ids(MESSAGES)
    ref = list(greedy_reference(tuple(prompt_ids), NEW_TOKENS))
    _, tok = hf_model()
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=NEW_TOKENS,
                                       temperature=0, logprobs=True, extra_body=IDS)
    assert as_ids([c.token for c in r.choices[0].logprobs.content]) == ref
    assert r.choices[0].message.content == tok.decode(ref)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), NEW_TOKENS)
    chunks = list(client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        logprobs=True, extra_body=IDS, stream_options={"include_usage": True}))
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[0].choices[0].delta.role == "assistant"
    streamed = [lp.token for c in with_choice if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert as_ids(streamed) == ref
    assert "".join(c.choices[0].delta.content or "" for c in with_choice) == tok.decode(ref)
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS


def test_stop_string_and_natural_stop(client):
    _, tok = hf_model()
    question = [{"role": "user", "content": "What is 2+2?"}]
    ref = list(greedy_reference(tuple(reference_ids(question)), 16))
    eos = ref.index(tok.eos_token_id)  # the 12-token reply ends with <|im_end|>
    r = client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == tok.decode(ref[:eos])
    assert r.usage.completion_tokens == eos + 1  # the EOS token counts as generated
    full = tok.decode(greedy_reference(tuple(reference_ids(PROMPT)), NEW_TOKENS))
    stop = full[4:8]
    cut = client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                    stop=[stop, "never-generated"])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


ADD_TOOL = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.mark.parametrize("choice", [None, "auto", "required",
                                    {"type": "function", "function": {"name": "add"}}],
                         ids=["default", "auto", "required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tools_on_a_template_without_tools_are_400_naming_tools(server, client, choice, stream):
    """SmolLM2's own template never reads ``tools``: a request that would use them (anything but
    ``tool_choice: none``) is refused before the engine sees it, instead of a made-up call."""
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="default", messages=MESSAGES, tools=ADD_TOOL,
                                       max_tokens=4, stream=stream, **kw)
    assert exc.value.status_code == 400
    assert exc.value.body == {"message": NO_TOOL_TEMPLATE, "type": "invalid_request_error",
                              "param": "tools", "code": "unsupported_value"}
    assert "start the server with a tool chat template, e.g. --chat-template hermes" in \
        NO_TOOL_TEMPLATE.lower()


def test_tool_choice_none_is_served_as_plain_chat_after_the_400s(server, client):
    """``tool_choice: none`` leaves the tools out of the prompt: the greedy reply of the plain
    conversation, token for token (the engine kept serving through the refused requests)."""
    _, tok = hf_model()
    question = [{"role": "user", "content": "What is 2+2?"}]
    ref = list(greedy_reference(tuple(reference_ids(question)), 16))
    eos = ref.index(tok.eos_token_id)
    r = client.chat.completions.create(model="default", messages=question, tools=ADD_TOOL,
                                       tool_choice="none", max_tokens=16, temperature=0)
    assert r.choices[0].message.content == tok.decode(ref[:eos])
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert httpx.get(f"{server}/health", timeout=60).status_code == 200


def test_malformed_requests_get_400_and_do_not_disturb_a_stream(server, client):
    ref = list(greedy_reference(tuple(reference_ids(PROMPT)), NEW_TOKENS))  # cached by the test above
    streamed: list[str] = []

    def run_stream() -> None:  # a greedy stream that runs while the bad requests arrive
        for chunk in client.completions.create(model="default", prompt=PROMPT, max_tokens=LONG_TOKENS,
                                                temperature=0, logprobs=0, stream=True, extra_body=IDS):
            if chunk.choices and chunk.choices[0].logprobs:
                streamed.extend(chunk.choices[0].logprobs.tokens)

    background = threading.Thread(target=run_stream)
    background.start()
    cases = malformed_cases(MAX_MODEL_LEN)
    assert len(cases) >= 20
    with httpx.Client(base_url=server, timeout=60) as h:
        for path, body, param, code in cases:
            if isinstance(body, bytes):
                r = h.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(path, json=body)
            check_error(r.status_code, r.json(), param, code)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="no-such-model", prompt="hi")
    assert exc.value.status_code == 400 and exc.value.body["param"] == "model"
    background.join(120)
    alone = client.completions.create(model="default", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0,
                                      logprobs=0, extra_body=IDS)
    assert as_ids(streamed) == as_ids(alone.choices[0].logprobs.tokens)  # undisturbed by the 400s
    assert as_ids(streamed)[:NEW_TOKENS] == ref and len(streamed) == LONG_TOKENS


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_aborts(server, stream):
    before = metric_samples(server)[("ppstate_requests_finished_total", (("finish_reason", "abort"),))]
    # the longest reply the server allows, so the request is still running when the client leaves
    body = {"model": "default", "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 8, "stream": stream,
            "ignore_eos": True}
    if stream:  # read three events, then drop the connection
        with httpx.Client(base_url=server, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
    else:  # send the request on a raw socket, drop it once the engine runs the request
        _post_then_drop_when_running(server, body)
    deadline = time.monotonic() + 20
    while True:
        s = metric_samples(server)
        done = (s[("ppstate_num_requests_running", ())] == 0
                and s[("ppstate_requests_finished_total", (("finish_reason", "abort"),))] == before + 1)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert s[("ppstate_num_requests_running", ())] == 0
    assert s[("ppstate_requests_finished_total", (("finish_reason", "abort"),))] == before + 1
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def _post_then_drop_when_running(url: str, body: dict) -> None:
    """POST ``body`` to /v1/completions over a raw socket and close the socket as soon as
    /metrics shows the request running (an observed event, not a read timeout)."""
    import socket
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        for _ in range(2000):  # hang guard only; each poll is one /metrics round trip
            if metric_samples(url)[("ppstate_num_requests_running", ())] >= 1:
                break
        else:
            pytest.fail("the request never started running")


def test_metrics_parse_and_hold_series(server):
    names = {fam.name for fam in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    expected = {"ppstate_time_to_first_token_seconds", "ppstate_inter_token_latency_seconds",
                "ppstate_time_per_output_token_seconds", "ppstate_e2e_request_latency_seconds",
                "ppstate_num_requests_running", "ppstate_num_requests_waiting", "ppstate_engine_steps",
                "ppstate_generation_tokens", "ppstate_rank_busy_seconds", "ppstate_pipeline_bubble_fraction",
                "ppstate_requests_finished", "ppstate_prompt_tokens", "ppstate_engine_alive"}
    assert expected <= names, expected - names
    s = metric_samples(server)
    assert s[("ppstate_pp_size", ())] == 2
    assert s[("ppstate_rank_busy_seconds_total", (("rank", "0"),))] > 0
    assert s[("ppstate_rank_busy_seconds_total", (("rank", "1"),))] > 0
    assert 0.0 <= s[("ppstate_pipeline_bubble_fraction", ())] < 1.0
    assert s[("ppstate_engine_steps_total", ())] > 0 and s[("ppstate_generation_tokens_total", ())] > 0


# ---- last: SIGTERM with a stream open stops this module's server -----------------------------
def bound_ipc_paths(pid: int) -> set[str]:
    """Paths of the unix sockets process ``pid`` holds (its zmq ipc endpoints)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and "ppstate-" in parts[7]:
            paths.add(parts[7])
    return paths


def test_sigterm_with_an_open_stream_ends_it_and_leaves_nothing(served):
    """Runs last in this module: it stops the server."""
    proc, url = served.proc, served.url
    workers = descendants(proc.pid)
    ipc = bound_ipc_paths(proc.pid)
    parent_of = parents()
    ranks = [w for w in workers if parent_of.get(w) not in (None, proc.pid)]  # the forkserver's children
    forkservers = {parent_of[w] for w in ranks}
    # 2 ranks, forked from one forkserver (a child of the server); results + 2 step sockets
    assert len(ranks) == 2 and all(alive(w) for w in ranks) and len(forkservers) == 1
    assert parent_of[forkservers.pop()] == proc.pid and len(ipc) == 3
    events: list[str] = []
    two = threading.Event()

    def read_stream() -> None:
        body = {"model": "default", "prompt": "1 2 3", "max_tokens": 40, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            events.append(str(resp.status_code))
            for ln in resp.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[len("data: "):])
                    if len(events) == 3:
                        two.set()
        two.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert two.wait(120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    served.reader.join(30)
    assert any(x.startswith("shutting down: ending open streams") for x in served.lines)  # says why
    reader.join(60)
    assert events[0] == "200" and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down" in err["message"], err
    assert 2 <= len(events) - 3 < 40                   # tokens came, the request did not finish
    # no orphan: multiprocessing's resource tracker (a child of the server) exits on its own once
    # the server's end of its pipe closes, a moment after the server; give it up to 10 s
    for _ in range(100):
        if not [w for w in workers if alive(w)]:
            break
        time.sleep(0.1)
    assert [w for w in workers if alive(w)] == []
    assert all(not os.path.exists(p) for p in ipc)     # no leaked socket files
    assert not os.path.exists(os.path.dirname(next(iter(ipc))))
