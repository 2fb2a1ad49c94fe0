"""Speculative decoding through the real multi-process engine (issue #14): PP=2 worker processes
over gloo, overlapped (pp_size + 1 steps in flight, so the scheduler issues a request's next row
before the previous row's rejections reach it and the ranks position it from their own corrected
counters), mirrors validated after every step on both ranks, behind the OpenAI app."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app_harness import COMP, AppEngine
from reference import greedy_reference
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from test_speculative_pipeline import ORDINARY, REPETITIVE

pytestmark = pytest.mark.slow
NEW = 20


@pytest.fixture(scope="module")
def spec_engine():
    eng = AppEngine(EngineConfig(pp_size=2, max_num_seqs=4, max_model_len=128, max_prefill_chunk=32,
                                 max_num_batched_tokens=64, num_spec_tokens=4, spec_ngram=3,
                                 step_timeout_s=120.0))
    yield eng
    eng.close()


def test_greedy_equals_reference_with_drafts_accepted(spec_engine):
    g = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

    async def go():
        return await asyncio.gather(spec_engine.collect("rep", REPETITIVE, g),
                                    spec_engine.collect("ord", ORDINARY, g))
    rep, ord_ = spec_engine.run(go())
    assert rep["token_ids"] == list(greedy_reference(tuple(REPETITIVE), NEW))
    assert ord_["token_ids"] == list(greedy_reference(tuple(ORDINARY), NEW))
    assert (rep["finish_reason"], ord_["finish_reason"]) == ("length", "length")
    s = spec_engine.engine.stats()
    assert s["spec_accepted_tokens"] >= 8 and s["generated_tokens_total"] == 2 * NEW


def test_logprobs_per_emitted_token_and_spec_metrics(spec_engine):
    body = {"model": "default", "prompt": REPETITIVE, "max_tokens": 9, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    r = spec_engine.post(COMP, body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert ids == list(greedy_reference(tuple(REPETITIVE), 9))
    assert len(lp["token_logprobs"]) == 9 and all(x <= 0 for x in lp["token_logprobs"])

    async def scrape():
        async with spec_engine.client() as c:
            return (await c.get("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(spec_engine.run(scrape()))}
    rate = fams["ppstate_spec_acceptance_rate"].samples[0].value
    per_row = fams["ppstate_spec_tokens_per_row"].samples[0].value
    assert 0 < rate <= 1 and per_row > 1


def test_stop_string_inside_an_accepted_run_ends_tokens_and_usage_there(spec_engine):
    """The cycle's drafts are accepted several at a time; a stop string completed by a token in
    the middle of such a run ends the request at that token (ids, logprobs, completion_tokens),
    as without speculation, not at the end of the run."""
    from runtime.model.registry import resolve_model_path
    from runtime.model.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model_path("default"))
    ref = list(greedy_reference(tuple(REPETITIVE), NEW))
    cut = next(i for i in range(1, NEW + 1) if "4," in tok.decode(ref[:i]))
    assert cut < NEW - 2
    s0 = spec_engine.engine.stats()
    body = {"model": "default", "prompt": REPETITIVE, "max_tokens": NEW, "temperature": 0,
            "stop": ["4,"], "logprobs": 0, "return_tokens_as_token_ids": True}
    r = spec_engine.post(COMP, body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert (ids, usage["completion_tokens"], choice["finish_reason"]) == (ref[:cut], cut, "stop")
    assert choice["text"] == tok.decode(ref[:cut]).split("4,")[0]
    s1 = spec_engine.engine.stats()
    assert s1["spec_accepted_tokens"] > s0["spec_accepted_tokens"]
    assert s1["generated_tokens_total"] - s0["generated_tokens_total"] == cut   # delivered only
