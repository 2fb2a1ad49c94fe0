"""The simulator sweep of tests/tools/test_sim.py: one small adversarial configuration per seed,
run seed by seed in worker processes.

The sweep is pure Python on one core; CI's machine has two, so :func:`sweep_violations` runs the
seeds in two ``spawn`` processes (no fork of a test process that may hold torch threads). Each
seed's run is deterministic and independent of the others and of the process it runs in (the
result of :func:`seed_violations` depends on the seed only), so the parallel sweep checks exactly
the runs the sequential loop did.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

from ppstate.sim import run_sim
from ppstate.sim.workload import SimConfig


def sweep_config(seed: int) -> SimConfig:
    """Small, adversarial runs: few slots (fast reuse), tiny chunks, aborts, both modes; a shared
    prompt prefix and a KV cache from "just one request fits" to roomy (preemptions, prefix hits,
    LRU eviction), prefix caching off on every fifth seed."""
    shared, bs = (0, 12, 21)[seed % 3], (1, 4, 8)[(seed // 5) % 3]
    blocks = -(-(shared + 40 + 24) // bs) + (0, 40, 400)[(seed // 2) % 3]
    return SimConfig(pp_size=2 + seed % 3, num_requests=10, seed=seed,
                     shared_prefix=shared, block_size=bs, num_kv_blocks=blocks,
                     enable_prefix_caching=seed % 5 != 4,
                     mode="sync" if seed % 7 == 3 else "overlapped",
                     prompt_len=(1, 40), output_len=(1, 24), max_prefill_chunk=(8, 16, 5)[seed % 3],
                     max_num_seqs=(3, 4, 8)[(seed // 3) % 3],
                     max_num_batched_tokens=(16, 24, 64)[(seed // 9) % 3],
                     abort_rate=0.25, arrival="poisson" if seed % 2 else "burst",
                     p2p_ticks=seed % 2, broadcast_ticks=(seed // 2) % 3)


def seed_violations(seed: int) -> tuple[int, list[dict]]:
    """``(num_violations, the first two invariant violations)`` of seed ``seed``'s sweep run."""
    res = run_sim(sweep_config(seed))
    return res.num_violations, res.invariant_violations[:2]


def sweep_violations(seeds: range, jobs: int = 2) -> dict[int, tuple[int, list[dict]]]:
    """:func:`seed_violations` of every seed in ``seeds`` (keyed by seed), in ``jobs`` processes."""
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        return dict(zip(seeds, pool.map(seed_violations, seeds, chunksize=8)))
