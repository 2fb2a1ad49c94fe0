"""Tensor parallelism composed with the other pipeline shapes (issue #35), real worker processes
over gloo: what ``python -m runtime.bench.tp_checks`` showed once, now in CI at a tiny size.

Two engines on one random Qwen2 (2 layers, q/k/v biases, 2 KV heads: one per TP rank), each
shared by its tests (module fixtures):

* TP=2 x PP=2 with the **sync** schedule, under the restart supervisor (``--restart-workers``):
  greedy ids equal transformers'; then (last, it kills a rank) SIGKILL of global rank 3 (stage 1,
  TP rank 1) mid-decode fails the in-flight request within seconds, the supervisor restarts the
  four rank processes and the restarted pipeline's greedy ids equal transformers' again;
* TP=2 x PP=2 x **DP=2** (8 rank processes, two replicas behind the least-loaded router): greedy
  ids equal transformers' for requests spread over both replicas.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from engine_harness import EngineThread
from families import build_family_model, generate_reference
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[100 + 7 * i + j for j in range(5 + 4 * i)] for i in range(4)]


def _config(folder, **kw) -> EngineConfig:
    base = dict(model=str(folder), tp_size=2, pp_size=2, device="cpu", dtype="float32",
                max_num_seqs=4, max_model_len=64, max_prefill_chunk=8, max_num_batched_tokens=32,
                step_timeout_s=30.0)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(folder, transformers' greedy ids of PROMPTS)."""
    folder = tmp_path_factory.mktemp("tp-qwen2")
    model = build_family_model("qwen2", folder, layers=2)
    return folder, generate_reference(model, PROMPTS, NEW)


@pytest.fixture(scope="module")
def sync_sup(qwen2):
    from runtime.engine.supervisor import EngineSupervisor
    start = functools.partial(EngineSupervisor.start, max_restarts=1, backoff_s=0.0)
    eng = EngineThread(_config(qwen2[0], mode="sync"), start=start)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def dp2(qwen2):
    from runtime.dp.replicas import start_engine
    eng = EngineThread(_config(qwen2[0], dp_size=2), start=start_engine)
    yield eng
    eng.close()


def _ids(eng: EngineThread, prefix: str) -> list[tuple[int, ...]]:
    return [tuple(r["token_ids"]) for r in eng.generate(PROMPTS, GREEDY, prefix=prefix)]


def test_tp2_pp2_sync_greedy_equals_transformers(sync_sup, qwen2):
    assert _ids(sync_sup, "s-") == qwen2[1]
    stats = sync_sup.engine.stats()
    assert (stats["pp_size"], stats["tp_size"], len(stats["rank_busy_seconds"])) == (2, 2, 4)


def test_tp2_pp2_killed_tp_rank_fails_in_flight_then_restart_recovers(sync_sup, qwen2):
    """Runs last on the supervised engine. SIGKILL of stage 1's TP rank 1 after 3 tokens."""
    sup = sync_sup.engine
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def go():
        n, killed, last = 0, None, None
        async for out in sup.add_request("victim", PROMPTS[0], long):
            n += len(out.new_token_ids)
            if n >= 3 and killed is None:
                os.kill(sup.engine.pool.procs[3].pid, signal.SIGKILL)
                killed = time.monotonic()
            last = out
        return last, n, time.monotonic() - killed

    last, n, failed_after = sync_sup.run(go(), timeout=120)
    assert last.error is not None and "rank(s) [3] died (rank 3: killed by SIGKILL)" in last.error
    assert 3 <= n < 50 and failed_after < 10.0
    deadline = time.monotonic() + 120
    while not sup.is_alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sup.is_alive and sup.restarts == 1
    assert _ids(sync_sup, "after-") == qwen2[1]


def test_tp2_pp2_dp2_greedy_equals_transformers(dp2, qwen2):
    assert _ids(dp2, "d-") == qwen2[1]
    stats = dp2.engine.stats()
    assert (stats["dp_size"], stats["pp_size"], stats["tp_size"]) == (2, 2, 2)
    per = [r["rank_busy_seconds"] for r in stats["replicas"]]
    assert [len(b) for b in per] == [4, 4] and all(x > 0 for b in per for x in b)   # both served
