"""runtime/worker/step_inputs.py (numpy + two uploads) against BatchMeta.build (torch), field by
field, on random decode, prefill-chunk and mixed steps over a shuffled block table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.model.batch_meta import BatchMeta
from runtime.worker.step_inputs import build_fast_meta

BS = 16
FIELDS = ("slots", "start_positions", "query_lens", "positions", "token_slots", "last_token",
          "num_tokens", "slot_bounds", "max_context", "slot_mapping", "block_tables", "seq_lens",
          "query_start_loc", "max_query_len", "max_seq_len", "block_size", "block_bounds", "groups")


def _table(rng, slots: int = 12, cols: int = 8) -> np.ndarray:
    return rng.permutation(slots * cols).reshape(slots, cols).astype(np.int32) + 3


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_fast_meta_equals_batch_meta_build(kind):
    rng = np.random.default_rng({"decode": 0, "prefill": 1, "mixed": 2}[kind])
    table = _table(rng)
    for _ in range(5):
        r = int(rng.integers(1, 10))
        slots = rng.permutation(12)[:r]
        if kind == "decode":
            qlen = np.ones(r, dtype=np.int64)
        elif kind == "prefill":
            qlen = rng.integers(2, 40, r)
        else:
            qlen = np.where(rng.random(r) < 0.5, 1, rng.integers(2, 30, r))
        start = rng.integers(0, 128 - qlen.max(), r)
        got = build_fast_meta(slots, start, qlen, table, BS, torch.device("cpu"))
        ref = BatchMeta.build(slots, start, qlen, "cpu", torch.from_numpy(table), BS,
                              attention_groups=False)
        for f in FIELDS:
            a, b = getattr(got, f), getattr(ref, f)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), f
            else:
                assert a == b, f


def test_fast_meta_rejects_what_batch_meta_rejects():
    table = _table(np.random.default_rng(3))
    with pytest.raises(ValueError, match="slot out of range"):
        build_fast_meta(np.array([12]), np.array([0]), np.array([1]), table, BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 9 blocks"):
        build_fast_meta(np.array([1]), np.array([128]), np.array([1]), table, BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="query_lens must be"):
        build_fast_meta(np.array([1]), np.array([0]), np.array([0]), table, BS, torch.device("cpu"))
