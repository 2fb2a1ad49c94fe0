"""A rank killed (SIGKILL) or frozen (SIGSTOP) during decode: real worker processes (issue #12).

The engine must notice (process exit, or no heartbeat for ``heartbeat_timeout_s``; the frozen
case runs with ``step_timeout_s`` far above the test's own timeout so only the heartbeat can
catch it), fail every in-flight request (non-stream: HTTP 503 JSON; stream: an error event, then
``[DONE]``), answer 503 on ``/health`` and leave no worker process behind.

The frozen case runs on the engine of the held-up-loop test (``heartbeat_timeout_s=2``), after
that test: one engine start less, and the freeze is noticed after 2 s of silence instead of 6.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal

import pytest

from app_harness import COMP, AppEngine
from runtime.config import EngineConfig

pytestmark = pytest.mark.slow

MAX_TOKENS = 80
BODY = {"model": "default", "prompt": "1 2 3", "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _rank_children() -> list:
    """Worker processes of any engine this test process started and that are still alive."""
    return [c for c in mp.active_children() if c.name.startswith("ppstate-rank")]


def sse(text: str) -> list:
    return [b[len("data: "):] if b == "data: [DONE]" else json.loads(b[len("data: "):])
            for b in text.strip().split("\n\n")]


def _fault_engine(**kw) -> AppEngine:
    return AppEngine(EngineConfig(pp_size=2, max_model_len=96, max_num_seqs=4, max_prefill_chunk=32,
                                  max_num_batched_tokens=64, step_timeout_s=3600.0, **kw))


@pytest.fixture(scope="module")
def hb2_engine():
    """``heartbeat_timeout_s=2``: first held up (it must survive), then frozen (it must die)."""
    eng = _fault_engine(heartbeat_timeout_s=2.0)
    yield eng
    if not getattr(eng, "closed", False):
        eng.close()


def test_engine_loop_held_up_longer_than_the_heartbeat_timeout_is_not_a_rank_failure(hb2_engine):
    """The 10,000-request load run on a starved machine once read a late-read heartbeat as a
    silent rank; silence is judged after draining what the ranks already sent."""
    import time

    from runtime.sampling_params import SamplingParams
    eng = hb2_engine

    async def hold_up():
        time.sleep(3 * eng.engine.config.heartbeat_timeout_s)  # the whole loop blocked
    eng.run(hold_up())
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    r = eng.run(eng.collect("after-hold", [100, 200, 300], params))
    assert eng.engine.is_alive and eng.engine.error is None
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 5


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_rank_killed_or_frozen_mid_decode_fails_every_request(fault, request):
    # SIGSTOP: the engine the held-up test left alive (runs after it in this module)
    eng = request.getfixturevalue("hb2_engine") if fault == "SIGSTOP" else _fault_engine()
    procs = list(eng.engine.pool.procs)
    before = {c.pid for c in _rank_children()} - {p.pid for p in procs}  # other tests' engines
    try:
        async def go():
            plain = asyncio.ensure_future(eng.apost(COMP, BODY))
            stream = asyncio.ensure_future(eng.apost(COMP, {**BODY, "stream": True}))
            sched, stats = eng.engine.sched, eng.engine.stats
            base = stats()["generated_tokens_total"]  # the SIGSTOP engine has served before
            while not (sched.num_running == 2 and stats()["generated_tokens_total"] >= base + 6):
                await asyncio.sleep(0.01)            # both decoding, tokens delivered
            os.kill(procs[1].pid, getattr(signal, fault))
            return await plain, await stream

        plain, stream = eng.run(go(), timeout=600)
        assert plain.status_code == 503
        err = plain.json()["error"]
        assert (err["type"], err["code"]) == ("service_unavailable", "engine_error")
        events = sse(stream.text)
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        texts = [e["choices"][0]["text"] for e in events[:-2]]
        assert 1 <= len(texts) < MAX_TOKENS           # some tokens came, then the error
        assert eng.health() == 503 and not eng.engine.is_alive
        if fault == "SIGSTOP":                       # only the heartbeat can have caught it
            assert "rank(s) [1] sent no heartbeat" in eng.engine.error
        else:
            assert "rank(s) [1] died (rank 1: killed by SIGKILL)" in eng.engine.error
        assert eng.engine.error in err["message"]
    finally:
        eng.close()
        eng.closed = True
    assert [p.is_alive() for p in procs] == [False, False]   # no orphan ranks
    assert not [c for c in _rank_children() if c.pid not in before]
