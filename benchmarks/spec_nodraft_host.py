"""Host cost per draft-free step that ``--spec-tokens K`` adds over a spec-off step (issue #33), on
the CPU, an old tree's code vs this tree's, alternated round by round in one process:

* **scheduler** (the engine process): ``Scheduler.schedule`` + ``on_step_result`` per step of one
  decoding request whose history never repeats (the probe finds no proposal), overlapped PP=1
  (two steps in flight, as the engine runs it): K = 0, and K = 4 with the probe, this tree's
  (bulk path, probe over slices) and the old tree's (its probe, and the row-by-row path it took
  for every step: ``_any_proposal`` forced True);
* **rank** (rank 0 / the last rank): the speculative work of a one-token step before the forward
  (``SpecDecoder.prepare``, the verify-graph input check, the ``any_drafts`` reads of the runner),
  the old tree's ``runtime/sampling/speculative_verify.py`` vs this tree's; a spec-off step does
  none of it.

    git show REV:runtime/sampling/speculative_verify.py > /tmp/spec4_old_speculative_verify.py
    git show REV:ppstate/speculative_probe.py > /tmp/spec4_old_speculative_probe.py
    PYTHONPATH=$PWD python benchmarks/spec_nodraft_host.py [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from ppstate.batch import StepResult
from ppstate.budget import SchedulerConfig
from ppstate.request import RequestSpec
from ppstate.scheduler import Scheduler
from ppstate.scheduler_rows import RowBuilder
from runtime.sampling import speculative_verify as new_sv
from runtime.worker.device_state import DeviceState
from runtime.worker.verify_graphs import VerifyGraphs

OLD = "/tmp/spec4_old_speculative_verify.py"
OLD_PROBE = "/tmp/spec4_old_speculative_probe.py"


def load(path: str, name: str):
    """The module at ``path`` (an old tree's file) as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scheduler_us(k: int, old_probe=None, steps: int = 2000) -> float:
    """Mean us per step of schedule + on_step_result (one request, no proposals); with
    ``old_probe`` (the old tree's ``ppstate/speculative_probe.py``) its probe and the row-by-row
    path on every step, as the old tree did."""
    per_row = old_probe is not None
    cfg = SchedulerConfig(pp_size=1, max_num_seqs=8, max_num_batched_tokens=2048,
                          max_model_len=4096, num_kv_blocks=512, block_size=16,
                          num_spec_tokens=k, spec_probe_ngram=3 if k else 0)
    sched = Scheduler(cfg)
    if old_probe is not None:
        sched.speculative_probe = old_probe.NgramProbe(3)
    sched.add_request(RequestSpec("a", tuple(range(100, 140)), steps + 8))
    orig = RowBuilder._any_proposal
    if per_row:
        RowBuilder._any_proposal = lambda self, order: True   # the old tree: always row by row
    try:
        pending, n, t0 = [], 0, time.perf_counter()
        for _ in range(steps):
            out = sched.schedule()
            if out is not None:
                pending.append(out)
            if pending and (out is None or len(pending) > 1):
                o = pending.pop(0)
                ids = np.zeros((o.num_rows, 1 + k), dtype=np.int64)
                ids[:, 0] = 1000 + n
                n += 1
                sched.on_step_result(StepResult(o.step, ids, o.is_final_chunk.astype(np.int32),
                                                np.zeros(o.num_rows, np.int32)))
        return (time.perf_counter() - t0) / steps * 1e6
    finally:
        RowBuilder._any_proposal = orig


def rank_us(sv, k: int, steps: int = 5000) -> float:
    """Mean us per one-token step of the rank's speculative work before the forward."""
    state = DeviceState(8, 1024, 1 + k, torch.device("cpu"), 0, 16)
    state.track_tokens()
    m = state.mirror
    m.num_computed_tokens_np[2] = m.prefill_len_np[2] = m.num_computed_prefill_tokens_np[2] = 40
    vg = SimpleNamespace(w=k + 1, buckets=[1, 2, 4, 8], graphs={})
    out = SimpleNamespace(slots=np.array([2], np.int32), step=0, num_rows=1,
                          num_scheduled_tokens=np.array([1], np.int32))
    dec = sv.SpecDecoder(k, 3, is_first=True, is_last=True)
    t0 = time.perf_counter()
    for i in range(steps):
        m.num_computed_tokens_np[2] = 40 + i % 900
        starts = dec.prepare(out, state)
        if sv is not new_sv or dec.rows.any_drafts:   # the old tree built them every step
            VerifyGraphs.inputs(vg, out.slots, starts, out.num_scheduled_tokens, dec.rows.decode,
                                state.block_table_np, 16)
        for _ in range(3):   # step_forward, step_sampler, runner.apply_sampled
            dec.rows.any_drafts
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    old_sv, old_probe = load(OLD, "old_sv"), load(OLD_PROBE, "old_probe")
    cases = {"scheduler K=0": lambda: scheduler_us(0),
             "scheduler K=4 (old)": lambda: scheduler_us(4, old_probe),
             "scheduler K=4 (this tree)": lambda: scheduler_us(4),
             "rank K=4 (old)": lambda: rank_us(old_sv, 4),
             "rank K=4 (this tree)": lambda: rank_us(new_sv, 4),
             "rank K=2 (old)": lambda: rank_us(old_sv, 2),
             "rank K=2 (this tree)": lambda: rank_us(new_sv, 2)}
    res: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            res[name].append(fn())
    report = {name: {"best_us": round(min(v), 2), "median_us": round(float(np.median(v)), 2),
                     "runs_us": [round(x, 2) for x in v]} for name, v in res.items()}
    for name, r in report.items():
        print(f"{name:32s} best {r['best_us']:8.2f} us/step  median {r['median_us']:8.2f}  {r['runs_us']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rounds": args.rounds, "cases": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
