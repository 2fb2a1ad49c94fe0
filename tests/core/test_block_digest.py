"""Block-id digests (ppstate/block_digest.py): the scheduler's per-row digest is the digest of the
block ids its pool gave the row's request, through preemption, prefix hits and slot reuse; a rank's
table digests agree; any shifted id or count changes the digest."""

from __future__ import annotations

import numpy as np

from ppstate.batch import StepResult
from ppstate.block_digest import BlockDigests, digest_of, row_digests
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig


def test_scheduler_digests_are_the_pools_tables_under_preemption_and_prefix_hits():
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=4, max_prefill_chunk=8, max_model_len=64,
                          block_size=4, num_kv_blocks=14, enable_prefix_caching=True)
    sched = Scheduler(cfg)
    shared = tuple(range(100, 112))
    for i in range(6):
        sched.add_request(RequestSpec(req_id=f"r{i}", prompt_token_ids=shared + (200 + i,) * (i + 1),
                                      max_tokens=12, eos_token_ids=frozenset({2})))
    n = cfg.max_num_seqs
    table = np.zeros((n, -(-cfg.max_model_len // cfg.block_size)), dtype=np.int32)  # a rank's
    counts = np.zeros(n, dtype=np.int64)
    rows_checked, pending = 0, []
    for _ in range(400):
        out = sched.schedule()
        if out is not None:
            for nr in out.new_requests:
                table[nr.slot], counts[nr.slot] = 0, 0
            table[out.block_table_slots, out.block_table_cols] = out.block_table_ids
            np.maximum.at(counts, out.block_table_slots.astype(np.int64),
                          out.block_table_cols.astype(np.int64) + 1)
            for i, rid in enumerate(out.req_ids):
                assert int(out.block_digests[i]) == digest_of(sched.kv.pool.table(rid)), (out.step, rid)
            assert row_digests(table, counts, out.slots).tolist() == out.block_digests.tolist()
            rows_checked += out.num_rows
            pending.append(out)
        if (out is None or len(pending) > 2) and pending:
            o = pending.pop(0)
            sched.on_step_result(StepResult(o.step, np.full((o.num_rows, 1), 7, dtype=np.int64),
                                            o.is_final_chunk.astype(np.int32),
                                            np.zeros(o.num_rows, dtype=np.int32)))
        if not sched.has_unfinished() and not pending:
            break
    stats = sched.kv_stats()
    assert not sched.has_unfinished() and rows_checked > 50
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_any_shift_or_count_change_changes_the_digest():
    ids = [5, 0, 9, 3]
    base = digest_of(ids)
    assert digest_of([5, 0, 9]) != base and digest_of(ids + [0]) != base
    for c in range(4):
        for d in (-1, 1, 1 << 20):
            moved = list(ids)
            moved[c] += d
            assert digest_of(moved) != base
    assert digest_of([i + 1 for i in ids]) != base
    d = BlockDigests(2, 8)
    d.apply([1], np.array([1, 1]), np.array([0, 1]), np.array([5, 0]))
    d.apply([], np.array([1, 1]), np.array([2, 3]), np.array([9, 3]))
    assert int(d.of(np.array([1]))[0]) == base and int(d.values[0]) == 0
    d.apply([1], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert int(d.values[1]) == 0 and d.num_blocks.tolist() == [0, 0]   # re-admitted: empty
