"""``python -m runtime.bench.cpu_step``: one whole-model step of the CPU fast path against the
exact reference, in this process (no server, no pipeline): decode steps of ``--rows`` rows at a
64-token context and one prefill chunk of ``--prefill`` tokens, by thread count. The two stages
run in turn step by step (A B A B), so machine load hits both alike; the report gives the median
milliseconds per step (wall clock, ``ms``, and CPU time of the process, all its threads,
``cpu_ms``: on a machine shared with other jobs the CPU time is the steadier figure) and the
exact / fast ratios.

With ``--before REV`` a third stage runs in the same turns: the fast path as it was at git
revision ``REV`` (its ``fast_stage.py`` and ``segments.py``, the rest of the tree as it is now), so
one run measures a change of the fast path before / after.

Usage: ``python -m runtime.bench.cpu_step [--threads 1,2] [--rows 1,8,64] [--prefill 256]
[--before REV] [--json-out F]``
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from runtime.bench.results import command_line, write_result
from runtime.model.batch_meta import BatchMeta
from runtime.model.cpu.fast_stage import load_fast_stage
from runtime.model.cpu.sessions import init_threads
from runtime.model.stage import load_stage

CONTEXT = 64


def _meta(stage, rows: int, qlen: int) -> BatchMeta:
    start = 0 if qlen > 1 else CONTEXT
    return BatchMeta.build(torch.arange(rows), torch.full((rows,), start),
                           torch.full((rows,), qlen), "cpu", stage.default_block_table,
                           stage.block_size, attention_groups=True)


def time_pair(stages: dict, rows: int, qlen: int, reps: int) -> dict:
    """Median wall and CPU ms per step of each stage, taken in turn."""
    ids = torch.randint(100, 20000, (rows * qlen,))
    metas = {k: _meta(s, rows, qlen) for k, s in stages.items()}
    wall, cpu = {k: [] for k in stages}, {k: [] for k in stages}
    for i in range(reps + 1):
        for k, s in stages.items():
            t0, c0 = time.perf_counter(), time.process_time()
            s(metas[k], input_ids=ids)
            if i:   # first round: warm-up
                wall[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.process_time() - c0) * 1e3)
    med = {k: round(statistics.median(v), 2) for k, v in wall.items()}
    cmed = {k: round(statistics.median(v), 2) for k, v in cpu.items()}
    out = {"rows": rows, "query_len": qlen, "ms": med, "cpu_ms": cmed,
           "exact_over_fast": round(med["exact"] / med["fast"], 2),
           "exact_over_fast_cpu": round(cmed["exact"] / cmed["fast"], 2)}
    if "fast_before" in med:
        out["before_over_fast"] = round(med["fast_before"] / med["fast"], 2)
        out["before_over_fast_cpu"] = round(cmed["fast_before"] / cmed["fast"], 2)
    return out


def fast_stage_at(rev: str):
    """``load_fast_stage`` of the fast path at git revision ``rev`` (modules written to a temporary
    folder and imported under private names; raises CalledProcessError for an unknown ``rev``)."""
    folder = Path(tempfile.mkdtemp(prefix="cpu_step_before_"))
    for name in ("segments", "fast_stage"):
        src = subprocess.run(["git", "show", f"{rev}:runtime/model/cpu/{name}.py"], check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from runtime.model.cpu.segments import", "from _before_segments import")
        (folder / f"_before_{name}.py").write_text(src)
    sys.path.insert(0, str(folder))
    for name in ("segments", "fast_stage"):
        spec = importlib.util.spec_from_file_location(f"_before_{name}", folder / f"_before_{name}.py")
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod.load_fast_stage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also time the fast path of git revision REV (before / after a change)")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    kw = dict(max_num_reqs=max(rows), max_model_len=max(a.prefill, CONTEXT) + 8)
    results = []
    before = fast_stage_at(a.before) if a.before else None
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)   # the exact path's GEMMs; the fast path's attention uses it too
        init_threads(threads)            # sessions opened from now on
        stages = {"exact": load_stage("default", (0, 30), progress=False, **kw),
                  "fast": load_fast_stage("default", (0, 30), **kw)}
        if before is not None:
            stages["fast_before"] = before("default", (0, 30), **kw)
        for r in rows:
            results.append({"threads": threads, **time_pair(stages, r, 1, a.reps)})
            print(results[-1], flush=True)
        results.append({"threads": threads, **time_pair(stages, 1, a.prefill, max(2, a.reps // 2))})
        print(results[-1], flush=True)
    if a.json_out:
        write_result(a.json_out, "cpu_step", {"steps": results}, vars(a), command_line(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
