"""Abort storm, scaled down for CI (issue #12 item 2; the full size is ``python -m
runtime.bench.storm`` with its defaults): 30 streams on a real PP=2 engine, 15 leave early
(before the first token, mid-decode, during chunked prefill)."""

from __future__ import annotations

import asyncio

import pytest

from runtime.bench.storm import run
from runtime.config import EngineConfig

pytestmark = pytest.mark.slow

STREAMS, LEAVE, MAX_TOKENS = 30, 15, 10


def test_storm_others_complete_slots_free_generations_once_per_free(tmp_path):
    config = EngineConfig(pp_size=2, max_num_seqs=8, max_model_len=128, max_prefill_chunk=16,
                          max_num_batched_tokens=64, step_timeout_s=300.0, trace_dir=str(tmp_path))
    r = asyncio.run(run(config, STREAMS, LEAVE, MAX_TOKENS, seed=3))
    assert r["failed"] == []                  # stayers: exactly MAX_TOKENS; after-storm request exact
    assert r["completed"] + r["aborted"] == STREAMS and r["completed"] >= STREAMS - LEAVE
    assert r["slots_free"] == 8
    never_admitted = sum(n for k, n in r["leave_phases"].items() if k.endswith("@waiting"))
    assert r["leave_phases"].get("before_first@waiting") == LEAVE // 3  # one third leave at once
    gens = r["generations"]
    assert gens["ranks_checked"] == ["rank0"] and gens["mismatched_slots"] == {}
    # every admitted request (the after-storm one too) was freed exactly once
    assert gens["freed_total"] == STREAMS + 1 - never_admitted
