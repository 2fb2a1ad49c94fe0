"""Random check layouts and planted faults for the fused mirror-check kernel's tests
(tests/runtime/test_mirror_check_kernel.py under the interpreter, tests/gpu compiled): a healthy
case, each fault kind, the flag each should give and the torch path's (CheckGraph mode ``graph``)
flag and digests."""

import numpy as np
import torch

from ppstate.block_digest import column_weights
from runtime.worker.check_graph import blocks_short_or_over, table_digests

BS, SLACK = 16, 2


def _case(seed: int, n: int, cols: int, size: int):
    """A healthy random check: (snap, exp, held, computed, aux, table, weights, w0)."""
    g = np.random.default_rng(seed)
    snap = g.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32)
    held = g.integers(0, cols + 1, n)
    computed = np.maximum(held * BS - g.integers(0, BS + SLACK, n), 0)
    computed[held == 0] = 0
    table = np.zeros((n, cols), dtype=np.int32)
    for s in range(n):
        table[s, :held[s]] = g.integers(0, 10_000, held[s])
    w = column_weights(cols + 1).view(np.int64)
    dig = (table.astype(np.int64) * w[1:]).sum(axis=1) + held * w[0]
    aux = np.stack([g.integers(0, 2, n), g.integers(0, 2, n), dig])
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dt)  # noqa: E731
    return (t(snap, torch.int32), t(snap.copy(), torch.int32), t(held, torch.int64),
            t(computed, torch.int64), t(aux, torch.int64), t(table, torch.int32),
            t(w[1:].copy(), torch.int64), int(w[0]))


def _torch_flag(snap, exp, held, computed, aux, table, w, w0):
    """CheckGraph._torch_flag's arithmetic (mode ``graph``): (flag, digests)."""
    dig = torch.add(table_digests(table, w), held, alpha=w0)
    bad = blocks_short_or_over(held, computed, BS, SLACK, aux[0] != 0)
    bad_digest = ((dig != aux[2]) & (aux[1] != 0)).any()
    return bool(torch.ne(snap, exp).any() | bad | bad_digest), dig


def _plant(case, fault: str, slot: int):
    snap, exp, held, computed, aux, table, w, w0 = case
    aux[0, slot] = aux[1, slot] = 1
    if fault == "word":                 # one flat-layout word (any field) differs
        snap[(slot * 37) % snap.numel()] ^= 1 << (slot % 31)
    elif fault == "short":              # fewer blocks than the computed tokens need
        computed[slot] = held[slot] * BS + 1
    elif fault == "over":               # more blocks than the tokens and drafts need
        computed[slot] = held[slot] * BS - BS - SLACK
    elif fault == "both_tables":        # device table wrong, flat copies agree: only the digest
        table[slot, 0] += 1
    elif fault == "want":               # the scheduler's digest differs
        aux[2, slot] += 1
    elif fault == "off_row":            # a digest miss on a row that is not the step's: passes
        aux[1, slot] = 0
        aux[2, slot] += 1
    elif fault == "dead":               # a bad count on a dead slot: passes
        aux[0, slot] = 0
        computed[slot] = held[slot] * BS + 1


FAULTS = ["none", "word", "short", "over", "both_tables", "want", "off_row", "dead"]
EXPECT = {"none": False, "word": True, "short": True, "over": True, "both_tables": True,
          "want": True, "off_row": False, "dead": False}
