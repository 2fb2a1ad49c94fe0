"""The padded layout of speculative verify steps (runtime/worker/verify_graphs.py, #33) gives the
same hidden states at every real token as the compact eager step and writes no KV at padded
positions; run eagerly on the CPU (the graph captures the same calls on CUDA) with the Triton
kernels under the interpreter. (The last stage's logits at every real token are checked through
the runner in tests/runtime/test_spec_fast_path.py.)"""

from __future__ import annotations

import numpy as np
import torch

from runtime.bench.gpu_models import random_stage
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.worker.verify_graphs import VerifyGraphs

BS, NB, MAXLEN, K = 4, 64, 32, 3


def test_padded_verify_step_equals_compact_step(monkeypatch):
    """The first layer of the tiny model (a first, non-last stage: hidden states out); the
    prefill on the torch kernels, the verify step on the Triton kernels under the interpreter."""
    dev = torch.device("cpu")
    torch.manual_seed(0)
    results = {}
    for layout in ("compact", "padded"):
        monkeypatch.delenv("PPSTATE_TRITON_INTERPRET", raising=False)
        stage = random_stage("tiny", (0, 1), dev, torch.float32, block_size=BS)
        model = PagedStage(stage, num_blocks=NB, max_model_len=MAXLEN)
        model.kv_cache.zero_()
        table = np.zeros((6, MAXLEN // BS), dtype=np.int32)           # [slots, cols]
        table[:] = np.random.default_rng(0).permutation(NB)[:table.size].reshape(table.shape)
        slots = np.array([4, 1, 3])
        ids = torch.randint(0, 512, (3, 12), generator=torch.Generator().manual_seed(1))
        model.forward(PagedMeta.build(table[slots], [0] * 3, [7] * 3, BS, dev, 2),
                      input_ids=ids[:, :7].reshape(-1))                 # prefill 7 tokens
        q = np.array([4, 1, 3])                                       # k = 3, 0, 2 drafts
        step_ids = torch.cat([ids[i, 7:7 + n] for i, n in enumerate(q)])
        starts = np.array([7, 7, 7])
        monkeypatch.setenv("PPSTATE_TRITON_INTERPRET", "1")
        if layout == "compact":
            logits = model.forward(PagedMeta.build(table[slots], starts, q, BS, dev, 2),
                                   input_ids=step_ids)
        else:
            vg = VerifyGraphs(model, 4, MAXLEN // BS, MAXLEN, K)
            vin = vg.inputs(slots, starts, q, np.ones(3, bool), table, BS)
            assert vin is not None and vin.bucket == 4 and vin.num_tokens == 8
            logits = vg.run(vin, input_ids=step_ids)
        results[layout] = (logits, model.kv_cache.clone())
    (lc, kvc), (lp, kvp) = results["compact"], results["padded"]
    assert lp[0].shape == (8, 64) and lp[1].shape == (8, 64)     # (hidden, residual) [T, H]
    torch.testing.assert_close(lp, lc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kvp, kvc)        # padded positions / rows wrote nothing


def test_steps_a_verify_graph_does_not_take():
    stage = random_stage("tiny", (0, 1), torch.device("cpu"), torch.float32, block_size=BS)
    vg = VerifyGraphs(PagedStage(stage, num_blocks=NB, max_model_len=MAXLEN), 4, 8, MAXLEN, K)
    table = np.zeros((6, 8), dtype=np.int32)
    args = (np.array([0, 1]), np.array([5, 5]))
    assert vg.inputs(*args, np.array([1, 1]), np.array([True, True]), table, BS) is None   # no drafts
    assert vg.inputs(*args, np.array([2, 6]), np.array([True, False]), table, BS) is None  # prefill row
    assert vg.inputs(np.arange(5), np.full(5, 5), np.full(5, 2), np.ones(5, bool), table, BS) is None
