"""One bad request never takes the server down (issue 19), against a real engine (PP=2 workers).

* The issue's two reproductions: ``top_k`` 2**63 is served, a lone surrogate is a 400 naming the
  field; /health stays 200.
* Isolation: a per-request failure is planted at each stage of ``runtime.engine.faults`` while another
  greedy stream runs; that stream ends with exactly the tokens of an undisturbed run, the bad
  request gets a clear error, the engine keeps serving.
* A property test: arbitrary JSON in every field of both schemas gives 200 or 4xx, never 5xx, and
  /health stays 200 (bounded examples; ``python -m runtime.server.fuzz`` is the long run).
* The other side: a failure outside any request scope stops the engine (own engine, last).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import runtime.engine.admission as admission_mod
import runtime.engine.async_engine as engine_mod
import runtime.engine.result_delivery as delivery_mod
from app_harness import CHAT, COMP, AppEngine
from runtime.config import EngineConfig
from runtime.engine.faults import ENGINE, REQUEST, RequestFailure, classify, request_scope
from runtime.messages import TransportError
from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.sampling_params import SamplingParams
from runtime.server.fuzz import CHAT_FIELDS, COMPLETION_FIELDS, INTS, STRINGS

pytestmark = pytest.mark.slow

GOOD = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
MARK_SEED = 424242  # the planted faults hit only requests with this seed / a "FAIL" stop string


@pytest.fixture(scope="module")
def eng(served_engine):
    return served_engine


@pytest.fixture(scope="module")
def good_ids(eng) -> list[int]:
    return eng.engine.tokenizer.encode("The capital of France is")


@pytest.fixture(scope="module")
def undisturbed(eng, good_ids) -> list[int]:
    res = eng.run(eng.collect("undisturbed", good_ids, GOOD))
    assert res["finish_reason"] == "length" and len(res["token_ids"]) == GOOD.max_tokens
    return res["token_ids"]


# ---- the reproductions --------------------------------------------------------------
def test_top_k_beyond_int64_is_served_as_no_cut(eng):
    body = {"model": "default", "prompt": "1 2 3 4 5 ", "max_tokens": 4, "temperature": 1.0,
            "top_k": 9223372036854775808}
    r = eng.post(COMP, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] in range(1, 5)
    for k in (9999999, 2**63 - 1, 10**40, 0, -1):  # all "no cut"
        assert eng.post(COMP, {**body, "top_k": k}).status_code == 200
    assert eng.health() == 200 and eng.engine.is_alive


def test_lone_surrogate_is_400_naming_the_field(eng):
    r = eng.post(COMP, b'{"model":"default","prompt":"Hi \\ud800 there","max_tokens":2}')
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("prompt", "invalid_value") and "UTF-8" in err["message"]
    assert eng.health() == 200


def test_seed_minus_one_and_missing_model_are_served(eng):
    r = eng.post(COMP, {"prompt": "1 2 3", "max_tokens": 2, "seed": -1})
    assert r.status_code == 200 and r.json()["model"] == eng.engine.model_name


@pytest.mark.parametrize("bad,stage", [({"top_k": 2**63}, "sampling_params"), ({"seed": 2**64}, "encode"),
                                       ({"stop": ["\ud800"]}, "encode")])
def test_engine_admission_rejects_what_workers_cannot_hold(eng, good_ids, bad, stage):
    """Past the HTTP checks (model_construct skips validation), the engine's own admission
    round trip fails the request alone, before the scheduler sees it."""
    params = SamplingParams.model_construct(**{**GOOD.model_dump(), **bad})
    with pytest.raises(RequestFailure) as info:
        eng.engine.add_request(f"raw-{stage}-{len(bad)}", good_ids, params)
    assert info.value.stage == stage
    assert eng.engine.is_alive and eng.engine.sched.num_waiting == 0


# ---- isolation: plant a failure at each request stage -----------------------------------------
class _FaultyDetok(IncrementalDetokenizer):
    """Fails (per its planted mode) only for a request whose stop strings include "FAIL"."""
    mode = ""

    def __init__(self, tokenizer, prompt, stop=(), **kw):
        self._planted = "FAIL" in tuple(stop)
        if self._planted and self.mode == "init":
            raise RuntimeError("planted: stop-string matcher")
        super().__init__(tokenizer, prompt, stop=stop, **kw)
        self._calls = 0

    def push(self, token_ids):
        self._calls += 1
        if self._planted and self.mode == "push" and self._calls == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted: detokenizer")
        return super().push(token_ids)

    def _release(self, delta, final):
        if self._planted and self.mode == "match" and self._calls >= 2:
            raise IndexError("planted: stop-string match")
        return super()._release(delta, final)


def _plant(monkeypatch, eng, stage: str) -> None:
    real_build, real_trip, real_lp = admission_mod.SamplingBatch.build, admission_mod.new_request_round_trip, delivery_mod.logprobs_for
    if stage == "sampling_params":
        class Batch(admission_mod.SamplingBatch):
            @classmethod
            def build(cls, params, index, device="cpu"):
                if params[0].seed == MARK_SEED:
                    raise OverflowError("planted: sampling parameters")
                return real_build(params, index, device)
        monkeypatch.setattr(admission_mod, "SamplingBatch", Batch)
    elif stage == "encode":
        def trip(msg):
            if msg.sampling.get("seed") == MARK_SEED:
                raise TransportError("planted: message encoding")
            return real_trip(msg)
        monkeypatch.setattr(admission_mod, "new_request_round_trip", trip)
    elif stage in ("stop_strings", "detokenize", "stop_match"):
        mode = {"stop_strings": "init", "detokenize": "push", "stop_match": "match"}[stage]
        monkeypatch.setattr(_FaultyDetok, "mode", mode)
        monkeypatch.setattr(engine_mod, "IncrementalDetokenizer", _FaultyDetok)
    elif stage == "logprobs":
        def lp(result, row_of, req_id, token_ids):
            stream = eng.engine._streams.get(req_id)
            if stream is not None and stream.params.seed == MARK_SEED and stream.num_output_tokens >= 2:
                raise KeyError("planted: logprobs")
            return real_lp(result, row_of, req_id, token_ids)
        monkeypatch.setattr(delivery_mod, "logprobs_for", lp)
    elif stage == "tokenize":
        tok = eng.engine.tokenizer
        real_encode = tok.encode

        def encode(text, *a, **kw):
            if "FAIL" in text:
                raise RuntimeError("planted: tokenizer")
            return real_encode(text, *a, **kw)
        monkeypatch.setattr(tok, "encode", encode)


STAGES = {  # planted stage -> (the faults stage named in the error, HTTP status of the bad request)
    "tokenize": ("tokenizing it failed", 400), "sampling_params": ("sampling parameters", 500),
    "encode": ("encoding it into a worker message", 500), "stop_strings": ("stop-string matcher", 500),
    "detokenize": ("detokenizing", 500), "stop_match": ("detokenizing", 500), "logprobs": ("logprobs", 500),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_planted_request_failure_leaves_other_stream_exact(eng, good_ids, undisturbed, monkeypatch, stage):
    _plant(monkeypatch, eng, stage)
    words, status = STAGES[stage]
    bad = {"model": "default", "prompt": "FAIL here: 1 2 3" if stage == "tokenize" else "1 2 3 4",
           "max_tokens": 8, "temperature": 0, "ignore_eos": True, "seed": MARK_SEED, "stop": ["FAIL"],
           "logprobs": 1}

    async def scenario():
        tokens: list[int] = []
        two = asyncio.Event()

        async def good():
            last = None
            async for out in eng.engine.add_request(f"good-{stage}", good_ids, GOOD):
                tokens.extend(out.new_token_ids)
                if len(tokens) >= 2:
                    two.set()
                last = out
            return last

        async def bad_request():
            await two.wait()
            return await eng.apost(COMP, bad)
        last, r = await asyncio.gather(good(), bad_request())
        return tokens, last, r

    tokens, last, r = eng.run(scenario())
    assert last is not None and last.finished and last.error is None, last
    assert last.finish_reason == "length" and tokens == undisturbed
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == ("invalid_value" if status == 400 else "request_failed")
    assert words in err["message"] and "planted" in err["message"], err
    if status == 400:
        assert err["param"] == "prompt"
    assert eng.health() == 200 and eng.engine.is_alive
    assert eng.engine.sched.num_running == 0  # the failed request's slot was freed
    monkeypatch.undo()
    again = eng.post(COMP, {**bad, "prompt": "1 2 3 4"})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_request_failure_in_a_stream_is_an_sse_error_event(eng, monkeypatch, path):
    _plant(monkeypatch, eng, "detokenize")
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": ["FAIL"], "stream": True,
            **({"prompt": "1 2 3 4"} if path == COMP else {"messages": [{"role": "user", "content": "Hi"}]})}
    r = eng.post(path, body)
    assert r.status_code == 200  # the stream had started
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "request_failed" and "detokenizing" in err["message"]
    assert eng.health() == 200 and eng.engine.sched.num_running == 0


def test_request_scope_classifies():
    with pytest.raises(RequestFailure) as info:
        with request_scope("r1", "detokenize"):
            raise ValueError("x")
    assert classify(info.value) == REQUEST and info.value.stage == "detokenize"
    assert isinstance(info.value.__cause__, ValueError) and "r1" in str(info.value)
    assert classify(RuntimeError("collective timed out")) == ENGINE
    with pytest.raises(ValueError, match="unknown request stage"):
        with request_scope("r1", "forward"):
            pass


# ---- property test: arbitrary JSON in every field -------------------------------------------
_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=6) | st.sampled_from(STRINGS)
_scalars = (st.none() | st.booleans() | st.sampled_from(INTS) | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | _text)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3),
                     max_leaves=6)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | _json,
                                  "content": _text | _json | st.lists(st.fixed_dictionaries(
                                      {"type": st.just("text") | _json, "text": _text | _json}), max_size=2)},
                                 optional={"name": _json})


_plausible = (st.none() | st.booleans() | st.sampled_from(INTS) | st.floats(-3, 3) | _text
              | st.lists(_text | st.sampled_from(INTS), max_size=3))


def _value(name: str):
    if name == "messages":
        return st.lists(_message, min_size=1, max_size=3) | _json
    return _plausible | _json


def _body(fields: list[str], base: dict):
    """``base`` with one to three fields (known or not) set to generated JSON."""
    names = st.lists(st.sampled_from(fields + ["bogus"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda ns: st.fixed_dictionaries({n: _value(n) for n in ns})).map(
        lambda d: {**base, **d})


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(req=st.one_of(
    st.tuples(st.just(COMP), _body(COMPLETION_FIELDS, {"prompt": "1 2 3", "max_tokens": 2})),
    st.tuples(st.just(CHAT), _body(CHAT_FIELDS, {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 2}))))
@example(req=(COMP, {"prompt": "1 2 3", "max_tokens": 2, "top_k": 2**63}))
@example(req=(COMP, {"prompt": "Hi \ud800 there", "max_tokens": 2}))
@example(req=(COMP, {"prompt": "1 2 3", "max_tokens": 2, "stop": ["\ud83d"]}))
@example(req=(CHAT, {"messages": [{"role": "user", "content": "x\udfff"}], "max_tokens": 2}))
def test_arbitrary_json_is_never_5xx(eng, req):
    path, body = req
    raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \udXXX escapes
    r = eng.post(path, raw)
    assert r.status_code < 500, (raw, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif not body.get("stream"):
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert eng.health() == 200


# ---- the other side: a failure of the step itself stops the engine --------------------------
def test_failure_outside_a_request_scope_stops_the_engine(good_ids):
    dying = AppEngine(EngineConfig(pp_size=2, max_model_len=64, max_num_seqs=4, step_timeout_s=60.0))
    try:
        sched = dying.engine.sched
        real = sched.on_step_result
        calls = {"n": 0}

        def on_step_result(result):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("planted: step bookkeeping")
            return real(result)
        sched.on_step_result = on_step_result
        res = dying.run(dying.collect("victim", good_ids, GOOD))
        assert res["finish_reason"] == "abort" and "planted: step bookkeeping" in res["error"]
        assert not dying.engine.is_alive and dying.health() == 503
    finally:
        dying.close()


def test_engine_failure_is_marked_engine_in_the_stream():
    from runtime.engine.request_stream import RequestStream

    async def go():
        s = RequestStream("r", GOOD, 3, None)
        s.finish("abort", error="rank 1 died", error_kind=ENGINE)
        return await s.get()
    out = asyncio.run(go())
    assert (out.error, out.error_kind, out.finish_reason) == ("rank 1 died", ENGINE, "abort")
