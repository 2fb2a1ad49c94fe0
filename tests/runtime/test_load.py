"""Load, scaled down for CI (issue #12 item 3; the full size is ``python -m runtime.bench.load``
with its defaults): 60 requests at concurrency 16 on a real PP=2 engine, every stream compared
token for token with its prompt's run in isolation, per-request maps empty / bounded after."""

from __future__ import annotations

import asyncio

import pytest

from runtime.bench.load import run
from runtime.config import EngineConfig

pytestmark = pytest.mark.slow


def test_load_exactly_once_and_bounded_maps():
    config = EngineConfig(pp_size=2, max_num_seqs=16, max_model_len=64, max_prefill_chunk=32,
                          max_num_batched_tokens=128, step_timeout_s=300.0)
    r = asyncio.run(run(config, 60, 16, distinct=8, max_tokens=6, seed=1))
    assert (r["completed"], r["mismatched"]) == (60, 0)
    # 60 load + 8 isolated requests finished: all remembered (< FINISHED_HISTORY), none live
    assert r["maps_after"] == {"engine_streams": 0, "engine_step_rows": 0, "sched_live": 0,
                               "sched_finished": 68, "sched_running": 0, "sched_waiting": 0,
                               "slot_table": 0, "kv_tables": 0, "lifecycle_models": 0}
    assert set(r["peak_rss_bytes"]) == {"engine", "rank0", "rank1"}
    assert all(v > 0 for v in r["peak_rss_bytes"].values())
