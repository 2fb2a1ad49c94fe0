"""The data-parallel router (runtime.dp.replicas.ReplicatedEngine) over scripted replicas: routing,
ownership, aborts, id conflicts, health and summed stats, exactly, without worker processes.
The real DP=2 x PP=2 engine is tested in tests/runtime/test_dp.py."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import EngineConfig
from runtime.dp.replicas import ReplicatedEngine, replica_config
from runtime.engine import EngineDeadError, RequestRejected
from runtime.engine.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server.metrics import ServerMetrics


class FakeSched:
    def __init__(self) -> None:
        self.live: set[str] = set()
        self.num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.live)

    def is_live(self, req_id: str) -> bool:
        return req_id in self.live


class FakeReplica:
    """A replica whose requests emit one token per ``release()`` and finish after ``n``."""

    def __init__(self) -> None:
        self.sched = FakeSched()
        self.is_alive, self.error = True, None
        self._streams: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        self.model_name, self.tokenizer = "m", object()
        self.tokens = 0

    def add_request(self, req_id, ids, params, fork_of=None):
        if req_id in self.sched.live:
            raise RequestRejected("request_id", "live")
        self.sched.live.add(req_id)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[req_id] = q

        async def gen():
            try:
                for i in range(params.max_tokens):
                    await q.get()
                    self.tokens += 1
                    last = i == params.max_tokens - 1
                    yield RequestOutput(req_id, [i], "", last, "length" if last else None, len(ids), i + 1)
            finally:
                self.sched.live.discard(req_id)
                self._streams.pop(req_id, None)
        return gen()

    def release(self, req_id: str) -> None:
        self._streams[req_id].put_nowait(None)

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)
        self.sched.live.discard(req_id)

    async def abort_all(self, message: str) -> None:
        self.aborted += sorted(self.sched.live)

    async def shutdown(self) -> None:
        self.is_alive = False

    def stats(self) -> dict:
        return {"num_running": self.sched.num_running, "num_waiting": 0, "steps_total": 2,
                "generated_tokens_total": self.tokens, "rank_busy_seconds": [1.0, 3.0],
                "bubble_fraction": 0.0, "pp_size": 2, "active_seconds": 4.0}


def make(n: int = 3) -> tuple[ReplicatedEngine, list[FakeReplica]]:
    reps = [FakeReplica() for _ in range(n)]
    return ReplicatedEngine(EngineConfig(pp_size=2, dp_size=n), reps), reps  # type: ignore[arg-type]


P = SamplingParams(max_tokens=2)


def test_least_loaded_with_round_robin_ties():
    async def go():
        eng, reps = make(3)
        order = []
        for i in range(3):                     # all idle: round robin 0, 1, 2
            eng.add_request(f"a{i}", [1], P)
            order.append(eng.owner_of(f"a{i}"))
        reps[0].sched.live.clear()             # replica 0 idle again -> least loaded
        eng.add_request("b", [1], P)
        order.append(eng.owner_of("b"))
        reps[2].sched.num_waiting = 5          # now loads (1, 1, 6): tie 0/1, cursor at 1
        eng.add_request("c", [1], P)
        order.append(eng.owner_of("c"))
        return order
    assert asyncio.run(go()) == [0, 1, 2, 0, 1]


def test_stream_end_forgets_owner_and_early_exit_aborts_on_owner():
    async def go():
        eng, reps = make(2)
        s0 = eng.add_request("x", [1], P)
        s1 = eng.add_request("y", [1], P)
        assert (eng.owner_of("x"), eng.owner_of("y")) == (0, 1)
        reps[0].release("x"), reps[0].release("x")
        got = [o.new_token_ids async for o in s0]
        assert got == [[0], [1]] and eng.owner_of("x") is None
        await eng.abort("y")                   # routed to replica 1 only
        assert (reps[0].aborted, reps[1].aborted) == ([], ["y"])
        await s1.aclose()
        await eng.abort("never-seen")           # unknown id: ignored
        return reps
    asyncio.run(go())


def test_id_live_on_any_replica_is_rejected_finished_id_reused():
    async def go():
        eng, reps = make(2)
        s = eng.add_request("dup", [1], P)
        with pytest.raises(RequestRejected) as e:
            eng.add_request("dup", [1], P)
        assert e.value.field == "request_id"
        reps[0].release("dup"), reps[0].release("dup")
        assert len([o async for o in s]) == 2
        eng.add_request("dup", [1], P)          # finished: the id is free again
        return eng.owner_of("dup")
    assert asyncio.run(go()) == 1               # round robin moved on


def test_dead_replica_makes_engine_dead_and_names_it():
    eng, reps = make(2)
    reps[1].is_alive, reps[1].error = False, "rank 0 failed"
    assert not eng.is_alive and eng.error == "replica 1: rank 0 failed"
    assert [d["alive"] for d in eng.health_detail()] == [True, False]
    with pytest.raises(EngineDeadError, match="replica 1"):
        eng.add_request("z", [1], P)


def test_stats_totals_and_replica_labels():
    async def go():
        eng, reps = make(2)
        s = eng.add_request("t", [1], SamplingParams(max_tokens=3))
        for _ in range(3):
            reps[0].release("t")
        assert len([o async for o in s]) == 3
        return eng
    eng = asyncio.run(go())
    st = eng.stats()
    assert (st["generated_tokens_total"], st["steps_total"], st["dp_size"]) == (3, 4, 2)
    assert st["rank_busy_seconds"] == [2.0, 6.0]
    assert st["bubble_fraction"] == pytest.approx(1 - 8.0 / (2 * 8.0))
    text = ServerMetrics(eng).render().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    toks = {s.labels["replica"]: s.value for s in fams["ppstate_replica_generation_tokens"].samples
            if s.name.endswith("_total")}
    assert toks == {"0": 3.0, "1": 0.0}
    assert fams["ppstate_dp_replicas"].samples[0].value == 2
    busy = {(s.labels["replica"], s.labels["rank"]): s.value
            for s in fams["ppstate_replica_rank_busy_seconds"].samples if s.name.endswith("_total")}
    assert busy == {("0", "0"): 1.0, ("0", "1"): 3.0, ("1", "0"): 1.0, ("1", "1"): 3.0}


def test_replica_config_is_one_pipeline_with_own_trace_dir(tmp_path):
    c = EngineConfig(dp_size=2, trace_dir=str(tmp_path))
    r1 = replica_config(c, 1)
    assert (r1.dp_size, r1.trace_dir) == (1, str(tmp_path / "replica1"))


def test_dp_flag_parsed_and_checked(capsys):
    from runtime.serve import parse_cli
    _, config = parse_cli(["--dp", "2", "--pp", "2", "--launcher", "spawn"])
    assert (config.dp_size, config.scheduler.pp_size) == (2, 2)
    with pytest.raises(SystemExit):
        parse_cli(["--dp", "0"])
    assert "--dp" in capsys.readouterr().err
