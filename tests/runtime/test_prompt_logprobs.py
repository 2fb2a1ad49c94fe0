"""Prompt logprobs on the last rank (runtime/sampling/prompt_logprobs.py) and logit_bias as
slot-indexed tables (runtime/sampling/logit_bias.py): exact plans and values on small arrays,
checked against direct per-row computation."""

from __future__ import annotations

import numpy as np
import torch

from runtime.sampling.batch import SamplingBatch
from runtime.sampling.sampler import sample
from runtime.sampling.sampling_state import SamplingState
from runtime.sampling.prompt_logprobs import PromptLogprobTable
from runtime.sampling_params import SamplingParams


def test_plan_widens_only_scoring_rows_and_splits_back():
    table = PromptLogprobTable(4)
    params = [SamplingParams(prompt_logprobs=2), SamplingParams(), SamplingParams(prompt_logprobs=0)]
    table.admit([0, 1, 2], params, [6, 5, 3])
    # rows: slot 0 chunk [0, 4) of 6; slot 1 decode; slot 2 final chunk [2, 3) of 3 (scores nothing:
    # position 2 is the last prompt token, its logits sample)
    slots, starts, n = np.array([0, 1, 2]), np.array([0, 7, 2]), np.array([4, 1, 1])
    plan = table.plan(slots, starts, n)
    assert plan.index.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.last_in_ext.tolist() == [3, 4, 5]
    assert plan.positions.tolist() == [1, 2, 3, 4] and plan.rows.tolist() == [0, 0, 0, 0]
    # final chunk [4, 6) of slot 0: scores position 5 only
    plan2 = table.plan(np.array([1, 0]), np.array([8, 4]), np.array([1, 2]))
    assert plan2.index.tolist() == [0, 1, 2] and plan2.last_in_ext.tolist() == [0, 2]
    assert plan2.positions.tolist() == [5] and plan2.score_entries.tolist() == [1]
    assert table.plan(np.array([1]), np.array([9]), np.array([1])) is None

    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    tokens = torch.zeros(4, 8, dtype=torch.int64)
    tokens[0, :6] = torch.tensor([3, 1, 4, 1, 5, 9])
    rows, pending = plan.split(logits, tokens)
    assert torch.equal(rows, logits[[3, 4, 5]])
    got = pending.host()
    lp = logits.log_softmax(-1)
    assert got.token_ids.tolist() == [1, 4, 1, 5]
    np.testing.assert_allclose(got.logprobs, [lp[p, t].item() for p, t in enumerate([1, 4, 1, 5])],
                               rtol=0, atol=1e-6)
    assert got.top_ids[0].tolist() == lp[0].topk(2).indices.tolist() and got.ks.tolist() == [2] * 4


def test_logit_bias_table_equals_the_per_row_batch():
    state = SamplingState(4, torch.device("cpu"))
    params = [SamplingParams(temperature=0, logit_bias=[(7, 100.0)]),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias=[(3, -100.0), (5, 2.5)])]
    state.admit([2, 0, 3], params, [4, 4, 4])
    torch.manual_seed(1)
    logits = torch.randn(3, 16)
    batch, _ = state.batch(np.array([2, 0, 3]), np.array([5, 5, 5]))
    ids = sample(logits, batch).token_ids.tolist()
    ref = sample(logits, SamplingBatch.build(params, [0, 0, 0])).token_ids.tolist()
    biased = logits.clone()
    biased[0, 7] += 100.0
    biased[2, 3] -= 100.0
    biased[2, 5] += 2.5
    assert ids == ref == biased.argmax(-1).tolist() and ids[0] == 7
    state.admit([2], [SamplingParams(temperature=0)], [4])     # the slot's next occupant: unbiased
    batch, _ = state.batch(np.array([2]), np.array([5]))
    assert batch.logit_bias is None
