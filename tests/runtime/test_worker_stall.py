"""A rank stuck inside a step while its heartbeat goes on (issue #12): real worker processes.

``PPSTATE_TEST_STALL=1:PHASE:N`` makes rank 1 sleep inside PHASE of its N-th decode-only step;
its heartbeat thread keeps beating, so neither the process check nor the heartbeat timeout can
see it, and the step timeout is set far beyond the test's own. Only the stall detector
(:mod:`runtime.engine.stall`) can end it: ``forward`` is a compute phase (one rank stuck); ``recv``
leaves every rank waiting (a distributed deadlock). Every in-flight request fails (non-stream:
HTTP 503 JSON; stream: an error event, then ``[DONE]``), ``/health`` answers 503, the message
names the rank and the phase, and no worker process is left.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import re

import pytest

from app_harness import COMP, AppEngine
from runtime.config import EngineConfig
from runtime.worker.heartbeat import HEARTBEAT_INTERVAL_S
from runtime.worker.progress import STALL_ENV

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 3.0
NOTICE_BOUND_S = 10.0  # the bound on noticing a stall, beyond the configured timeout
MAX_TOKENS = 80
STALL_AT = 6           # rank 1 stalls in its 6th decode-only step
BODY = {"model": "default", "prompt": "1 2 3", "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _rank_children() -> set[int]:
    return {c.pid for c in mp.active_children() if c.name.startswith("ppstate-rank")}


def _sse(text: str) -> list:
    return [b[len("data: "):] if b == "data: [DONE]" else json.loads(b[len("data: "):])
            for b in text.strip().split("\n\n")]


@pytest.mark.parametrize("phase", ["forward", "recv"])
def test_rank_stalled_inside_a_decode_step_fails_every_request(phase, monkeypatch):
    before = _rank_children()                  # engines other tests share stay alive
    monkeypatch.setenv(STALL_ENV, f"1:{phase}:{STALL_AT}")
    eng = AppEngine(EngineConfig(pp_size=2, max_model_len=96, max_num_seqs=4, max_prefill_chunk=32,
                                 max_num_batched_tokens=64, step_timeout_s=3600.0,
                                 stall_timeout_s=STALL_TIMEOUT_S))
    procs = list(eng.engine.pool.procs)
    try:
        async def go():
            plain = asyncio.ensure_future(eng.apost(COMP, BODY))
            stream = asyncio.ensure_future(eng.apost(COMP, {**BODY, "stream": True}))
            return await plain, await stream

        plain, stream = eng.run(go(), timeout=600)
        error = eng.engine.error
        assert plain.status_code == 503
        err = plain.json()["error"]
        assert (err["type"], err["code"]) == ("service_unavailable", "engine_error")
        assert error in err["message"]
        events = _sse(stream.text)
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        texts = [e["choices"][0]["text"] for e in events[:-2]]
        assert 1 <= len(texts) < MAX_TOKENS         # some tokens came, then the error
        assert eng.health() == 503 and not eng.engine.is_alive
        if phase == "forward":
            m = re.fullmatch(r"rank 1 stalled in phase 'forward' of step (\d+) for [\d.]+ s "
                             r"\((\d+) heartbeats; stall_timeout_s=3.0\)", error)
        else:
            m = re.search(r"^distributed deadlock: no rank computes, every rank waits \(rank 0 in "
                          r"'(?:broadcast-wait|idle|send)' of step \d+ for [\d.]+ s \(\d+ heartbeats\), "
                          r"rank 1 in 'recv' of step (\d+) for [\d.]+ s \((\d+) heartbeats\); "
                          r"stall_timeout_s=3.0\)$", error)
        assert m is not None, error
        step, beats = int(m.group(1)), int(m.group(2))
        assert step >= STALL_AT                     # prefill steps, then STALL_AT decode steps
        # noticed once the stalled phase outlived the timeout, within the bound: counted
        # in heartbeats the engine received from rank 1 in that phase
        assert 1 <= beats <= (STALL_TIMEOUT_S + NOTICE_BOUND_S) / HEARTBEAT_INTERVAL_S
    finally:
        eng.close()
    assert [p.is_alive() for p in procs] == [False, False]   # no orphan ranks
    assert not _rank_children() - before
