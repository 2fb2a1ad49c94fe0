"""Per-step host cost of ``TokenMirror.record`` (CPU) for one decode row with one id, payload
width 1 (spec off) vs ``K + 1`` (a draft-free step under ``--spec-tokens K``), an old version of
``runtime/worker/token_check.py`` vs the tree's, alternated round by round (issue #33)::

    git show REV:runtime/worker/token_check.py > /tmp/specprof_old_token_check.py
    PYTHONPATH=$PWD python benchmarks/token_mirror_record.py
"""
import sys, time, importlib.util
import numpy as np, torch
sys.path.insert(0, "/tmp")
import specprof_old_token_check as old
from runtime.worker import token_check as new
slots, num = np.array([0], np.int64), np.array([1], np.int64)
def bench(mod, width, n=20000):
    m = mod.TokenMirror(8, 1024, torch.device("cpu"))
    ids = torch.zeros(1, width, dtype=torch.int64)
    t0 = time.perf_counter()
    for i in range(n):
        ids[0, 0] = i
        m.record(ids, slots, np.array([100 + i % 800], np.int64), num)
    return (time.perf_counter() - t0) / n * 1e6
res = {}
for rnd in range(5):
    for name, mod in (("main", old), ("branch", new)):
        for k in (0, 2, 4):
            res.setdefault((name, k), []).append(bench(mod, k + 1))
for (name, k), v in sorted(res.items()):
    print(f"{name:6s} K={k}: record {min(v):.2f} us/step (best of 5; all {[round(x,1) for x in v]})")
