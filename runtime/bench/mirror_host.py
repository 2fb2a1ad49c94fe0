"""``python -m runtime.bench mirror --device host``: the host work of the CUDA mirror check,
measured on a machine without a GPU.

The rank's CPU cost of ``--validate-mirrors every`` on CUDA is host work: the token mirror's
bookkeeping of the sampled ids (:class:`~runtime.worker.token_check.TokenMirror`), the live and
step-row masks and digests written into the pinned buffer, the copy of the expected values, the
pending snapshot and, a step later, the poll and comparison
(:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`). :func:`fake_device` runs exactly that
code on the CPU with the device calls replaced by no-ops: the check's CUDA graph
(``replay``: a no-op; on an H200 one replay costs about 7.6 us of host time,
docs/mirror_audit.md), its events (complete at once) and the device's token-row digests (taken
equal to the host's: the healthy path, one extra ``[n]`` copy per step). The numbers are the
host time of everything else, on / off / as at ``--before-rev`` (its check after the flush, as
now: ``--before-deferred`` is implied), alternated in one run, in process CPU time (one torch
thread): what ``python -m runtime.bench mirror --device cuda`` measures in wall time, without
the CUDA driver calls. On a loaded machine these times move by tens of microseconds between
rounds; the function calls each mode adds to a step (:func:`calls_per_step`, counted by
cProfile) do not move at all.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics

import numpy as np
import torch

from runtime.bench.rank_loop import BLOCK, RankLoop
from runtime.worker.mirror_check import AsyncMirrorCheck


class _Event:
    """A CUDA event that has always completed."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Graph:
    """A CUDA graph whose replay does nothing (the device work is not measured here)."""

    def replay(self) -> None:
        pass


def fake_device(check, tokens) -> None:
    """Make ``check`` (an ``AsyncMirrorCheck`` of a CPU state, this revision's or an older
    one's) and its token mirror ``tokens`` take the CUDA path: events, graphs, the ids recorded
    now and applied a step later, the device's token digests equal to the host's."""
    check._pin = True
    check._events = [_Event(), _Event()]
    check.dev.use_graphs = True
    check.dev.graphs = [_Graph(), _Graph()]
    check._graphed_tokens = tokens
    tokens.device = torch.device("cuda")   # record(): the deferred path (no CUDA call made)
    compare = type(tokens).check
    tokens.check = lambda _dev, *a, **k: compare(tokens, tokens.digest_np.view(np.int64).copy(),
                                                 *a, **k)


def host_loop(rows: int, prompt_len: int, max_model_len: int,
              before_cls: tuple[type, type] | None) -> RankLoop:
    """A CPU :class:`RankLoop` whose modes True and ``"before"`` (None: no such mode) run the
    CUDA check's host work (:func:`fake_device`), the before revision's after the flush as now."""
    loop = RankLoop(rows, torch.device("cpu"), prompt_len, max_model_len, before_cls)
    loop.check = AsyncMirrorCheck(loop.state)
    fake_device(loop.check, loop.token_mirror)
    if before_cls is not None:
        loop.before = before_cls[0](loop.state)
        loop.before_deferred, loop.before_rides = True, False
        fake_device(loop.before, loop.before_tokens)
    return loop


def calls_per_step(loop: RankLoop, steps: int, mode) -> float:
    """Python and C function calls per step of ``steps`` steps of ``mode`` (cProfile's count:
    exact and independent of the machine's load)."""
    prof = cProfile.Profile()
    prof.enable()
    loop.block(steps, mode)
    prof.disable()
    return pstats.Stats(prof).total_calls / steps


def measure_host(rows: int, steps: int, rounds: int, prompt_len: int,
                 before_cls: tuple[type, type]) -> dict:
    """Off / on / before alternated ``rounds`` times (the order of on and before swapped every
    round) at ``rows`` decode rows: microseconds of process CPU per step, medians over rounds,
    and the validation's per round (on - off, before - off) with quartiles; the calls per step
    each adds to off (:func:`calls_per_step`)."""
    loop = host_loop(rows, prompt_len, prompt_len + (3 * rounds + 7) * steps + 2 * BLOCK,
                     before_cls)
    for mode in (True, "before", False):   # warm-up
        loop.block(steps, mode)
    per = {False: [], True: [], "before": []}
    for r in range(rounds):
        for mode in ((False, True, "before") if r % 2 == 0 else (False, "before", True)):
            per[mode].append(1e6 * loop.block(steps, mode))
    calls = {m: calls_per_step(loop, steps, m) for m in (False, True, "before")}
    med = statistics.median
    added = {m: [b - a for a, b in zip(per[False], per[m])] for m in (True, "before")}
    q = {m: [float(x) for x in np.percentile(added[m], [25, 75])] for m in added}
    return {"rows": rows, "device": "host", "us_per_step_off": med(per[False]),
            "us_per_step_on": med(per[True]), "before_us_per_step_on": med(per["before"]),
            "validation_us_per_step": med(added[True]), "validation_us_quartiles": q[True],
            "before_validation_us_per_step": med(added["before"]),
            "before_validation_us_quartiles": q["before"],
            "on_over_before_validation": med(added[True]) / med(added["before"]),
            "calls_per_step_added": calls[True] - calls[False],
            "before_calls_per_step_added": calls["before"] - calls[False],
            "validation_us_all": added[True], "before_validation_us_all": added["before"],
            "steps_per_block": steps, "rounds": rounds}
