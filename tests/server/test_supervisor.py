"""EngineSupervisor (``--restart-workers``) over fake engines: the restart sequence, what the app
answers meanwhile, the bound on restarts (a failed start counts), backoff and cumulative counters.
Engine starts are gated by events, so every state is observed exactly (no wall-clock waits). The
real processes are covered by test_worker_restart.py."""

from __future__ import annotations

import asyncio

import pytest

from runtime.engine import supervisor as sv
from runtime.engine import EngineDeadError
from runtime.sampling_params import SamplingParams
from runtime.engine.supervisor import EngineSupervisor
from test_server_api import CONFIG, FakeEngine, client_for


class DyingEngine(FakeEngine):
    """A FakeEngine that can be made to fail like a real one (``die``)."""

    def __init__(self) -> None:
        super().__init__()
        self.error: str | None = None
        self.shut = False

    def die(self, error: str) -> None:
        self.is_alive, self.error = False, error

    async def abort_all(self, message: str) -> None:
        for req_id in list(self.live):
            await self.abort(req_id)

    async def shutdown(self) -> None:
        self.shut, self.is_alive = True, False


class Starts:
    """``start_engine`` for the supervisor: each call waits for ``release()``, then returns a new
    engine, or raises EngineDeadError when the release said so."""

    def __init__(self) -> None:
        self.engines: list[DyingEngine] = []
        self.calls = 0
        self._gate: asyncio.Queue = asyncio.Queue()

    async def __call__(self, config) -> DyingEngine:
        self.calls += 1
        if self.calls > 1:                       # the first start is not gated
            if not await self._gate.get():
                raise EngineDeadError("engine failed to start: rank 0 could not load")
        self.engines.append(DyingEngine())
        return self.engines[-1]

    def release(self, ok: bool = True) -> None:
        self._gate.put_nowait(ok)


async def until(cond) -> None:
    while not cond():
        await asyncio.sleep(0)                   # yield to the supervisor's tasks only


@pytest.fixture(autouse=True)
def fast_watch(monkeypatch):
    monkeypatch.setattr(sv, "WATCH_INTERVAL_S", 0.0)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(s, *a):             # backoffs are recorded, not waited
        if s > 0:
            sleeps.append(s)
        await real_sleep(0)
    monkeypatch.setattr(sv.asyncio, "sleep", recorded_sleep)
    return sleeps


async def test_restart_sequence_health_requests_and_counters(fast_watch):
    starts = Starts()
    sup = await EngineSupervisor.start(CONFIG, max_restarts=2, backoff_s=1.0, start_engine=starts)
    first = sup.engine
    params = SamplingParams(max_tokens=3)
    async with client_for(sup) as c:
        outs = [o async for o in sup.add_request("a", [104, 105], params)]
        assert (outs[-1].finished, outs[-1].finish_reason, outs[-1].num_output_tokens) == \
            (True, "length", 3)        # served by the first engine before it dies
        first.die("worker process of rank(s) [1] died")
        await until(lambda: sup.restarting)
        h = await c.get("/health")
        assert (h.status_code, h.json()["status"], h.headers["retry-after"]) == (503, "restarting", "5")
        r = await c.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_restarting")
        with pytest.raises(EngineDeadError, match="restarting after a failure: worker process"):
            sup.add_request("b", [104], params)
        assert first.shut and not sup.is_alive

        starts.release()
        await until(lambda: sup.is_alive)
        assert sup.engine is starts.engines[1] and sup.restarts == 1
        assert (await c.get("/health")).json() == {"status": "ok"}
        r = await c.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        s = sup.stats()
        assert (s["engine_restarts_total"], s["steps_total"], s["generated_tokens_total"]) == (1, 5, 5)
        assert s["rank_busy_seconds"] == [3.0, 1.0]   # 1.5 + 1.5, 0.5 + 0.5
        assert "ppstate_engine_restarts_total 1.0" in (await c.get("/metrics")).text
        assert sup.failures == ["worker process of rank(s) [1] died"]
    await sup.shutdown()
    assert fast_watch == [1.0]


async def test_failed_start_counts_and_the_bound_is_final(fast_watch):
    starts = Starts()
    sup = await EngineSupervisor.start(CONFIG, max_restarts=3, backoff_s=1.0, start_engine=starts)
    sup.engine.die("rank 1 stalled in phase 'forward' of step 9 for 10.2 s")
    await until(lambda: sup.restarting)
    starts.release(ok=False)                     # restart 1 fails to start
    starts.release(ok=True)                      # restart 2 serves
    await until(lambda: sup.is_alive)
    assert (sup.restarts, starts.calls) == (2, 3)
    sup.engine.die("worker process of rank(s) [0] died")
    await until(lambda: sup.restarting)
    starts.release(ok=False)                     # restart 3 fails: the last one allowed
    await until(lambda: sup._watch.done())
    assert (sup.restarts, sup.is_alive, sup.restarting) == (3, False, False)
    assert sup.error == "worker process of rank(s) [0] died"
    assert [f.split(":")[0] for f in sup.failures] == [
        "rank 1 stalled in phase 'forward' of step 9 for 10.2 s", "engine failed to start",
        "worker process of rank(s) [0] died", "engine failed to start"]
    assert fast_watch == [1.0, 2.0, 4.0]         # backoff doubles per restart
    async with client_for(sup) as c:
        r = await c.get("/health")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_dead")
    await sup.shutdown()


async def test_no_restart_allowed_and_backoff_cap():
    starts = Starts()
    sup = await EngineSupervisor.start(CONFIG, max_restarts=0, backoff_s=1.0, start_engine=starts)
    sup.engine.die("boom")
    await until(lambda: sup._watch.done())
    assert (sup.restarts, starts.calls, sup.is_alive, sup.restarting) == (0, 1, False, False)
    assert [sup.backoff_for(k) for k in (1, 2, 5, 6, 7)] == [1.0, 2.0, 16.0, 30.0, 30.0]
    await sup.shutdown()
