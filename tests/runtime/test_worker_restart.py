"""``--restart-workers`` (issue #12): after a rank is killed the in-flight request fails as
without restarts, ``/health`` answers 503 ``restarting`` while fresh workers load, then 200, and a
later request returns exactly the transformers reference's greedy tokens. Restarts are bounded:
after ``max_restarts`` the next failure is final (503 ``engine_dead``, no worker left).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import pytest

from app_harness import COMP, AppEngine
from reference import greedy_reference
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.supervisor import EngineSupervisor

pytestmark = pytest.mark.slow

BODY = {"model": "default", "prompt": "1 2 3", "max_tokens": 60, "ignore_eos": True}
NEW_TOKENS = 8


def _rank_children() -> set[int]:
    return {c.pid for c in mp.active_children() if c.name.startswith("ppstate-rank")}


async def _kill_rank_mid_decode(eng: AppEngine, sup: EngineSupervisor):
    """POST a long request, SIGKILL rank 1 once tokens flow; returns the response."""
    tokens_before = sup.stats()["generated_tokens_total"]
    req = asyncio.ensure_future(eng.apost(COMP, BODY))
    while sup.stats()["generated_tokens_total"] < tokens_before + 4:
        await asyncio.sleep(0.01)
    os.kill(sup.engine.pool.procs[1].pid, signal.SIGKILL)
    return await req


async def _health_until(eng: AppEngine, status: int) -> list:
    """Poll /health until it answers ``status``; the distinct (code, body status) seen."""
    seen: list = []
    while True:
        code, body = await eng.ahealth()
        key = (code, body.get("status") or body.get("error", {}).get("code"))
        if not seen or seen[-1] != key:
            seen.append(key)
        if code == status:
            return seen
        await asyncio.sleep(0.05)


def test_killed_rank_is_replaced_and_later_requests_match_the_reference():
    before = _rank_children()
    config = EngineConfig(pp_size=2, max_model_len=96, max_num_seqs=4, max_prefill_chunk=32,
                          max_num_batched_tokens=64, step_timeout_s=3600.0)
    eng = AppEngine(config, start=lambda cfg: EngineSupervisor.start(cfg, max_restarts=1,
                                                                     backoff_s=0.0))
    sup = eng.engine
    first_procs = list(sup.engine.pool.procs)
    try:
        failed = eng.run(_kill_rank_mid_decode(eng, sup), timeout=600)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"
        seen = eng.run(_health_until(eng, 200), timeout=600)
        assert (503, "restarting") in seen and seen[-1] == (200, "ok")
        assert sup.restarts == 1 and len(sup.failures) == 1 and "rank" in sup.failures[0]
        assert [p.is_alive() for p in first_procs] == [False, False]
        second_procs = list(sup.engine.pool.procs)
        assert all(p.is_alive() for p in second_procs)

        prompt = eng.engine.tokenizer.encode("The capital of France is")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        got = eng.run(eng.collect("after-restart", prompt, params))
        assert got["finish_reason"] == "length" and got["error"] is None
        assert tuple(got["token_ids"]) == greedy_reference(tuple(prompt), NEW_TOKENS)

        metrics = eng.run(_get_metrics(eng)).decode()
        assert "ppstate_engine_restarts_total 1.0" in metrics

        failed = eng.run(_kill_rank_mid_decode(eng, sup), timeout=600)   # restarts used up
        assert failed.status_code == 503
        eng.run(_watch_done(sup), timeout=120)
        assert eng.run(eng.ahealth()) == (503, {"error": {
            "message": "The engine is not running.", "type": "service_unavailable",
            "param": None, "code": "engine_dead"}})
        assert sup.restarts == 1 and len(sup.failures) == 2 and not sup.is_alive
    finally:
        eng.close()
    assert [p.is_alive() for p in second_procs] == [False, False]
    assert not _rank_children() - before


async def _get_metrics(eng: AppEngine) -> bytes:
    async with eng.client() as c:
        return (await c.get("/metrics")).content


async def _watch_done(sup: EngineSupervisor) -> None:
    while not sup._watch.done():
        await asyncio.sleep(0.05)
