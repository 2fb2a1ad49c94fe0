"""Sampler penalties against independent references: transformers' RepetitionPenaltyLogitsProcessor
(repetition over prompt + output) and OpenAI's formula for presence / frequency, written out with
collections.Counter over the generated tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from runtime.sampling.batch import SamplingBatch
from runtime.sampling.penalties import TokenHistory, apply_penalties
from runtime.sampling.sampler import sample
from runtime.sampling_params import SamplingParams as SP

V = 512
L = 40  # history width (a slot's max_model_len)


def _case(seed: int, rows: int):
    """Random logits [rows, V] and per-row (prompt, output) histories laid out like device state."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 4
    ids = torch.randint(0, V, (rows, L), generator=g)  # stale tail entries are garbage on purpose
    plen = torch.randint(1, 15, (rows,), generator=g)
    tlen = plen + torch.randint(0, 20, (rows,), generator=g)
    # make repeats likely: draw part of each row's history from a few tokens
    ids[:, ::3] = torch.randint(0, 8, (rows, (L + 2) // 3), generator=g)
    return logits, TokenHistory(ids, plen, tlen)


def _openai_reference(row_logits: torch.Tensor, output: list[int], presence: float, frequency: float):
    """OpenAI's documented formula: mu[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    out = row_logits.clone()
    for tok, count in Counter(output).items():
        out[tok] -= count * frequency + presence
    return out


def test_repetition_penalty_equals_transformers_processor():
    rows = 6
    logits, hist = _case(0, rows)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05, 9.0]
    batch = SamplingBatch.build([SP(repetition_penalty=p) for p in penalties], [0] * rows)
    pen_rows = batch.penalty_rows.tolist()
    assert pen_rows == [1, 2, 3, 4, 5]  # the row with 1.0 is not penalised
    sub = TokenHistory(hist.token_ids[pen_rows], hist.prompt_len[pen_rows], hist.total_len[pen_rows])
    got = apply_penalties(logits, batch, sub)
    assert torch.equal(got[0], logits[0])
    for r in pen_rows:
        seq = hist.token_ids[r, : hist.total_len[r]].unsqueeze(0)  # prompt + output, as HF sees it
        want = RepetitionPenaltyLogitsProcessor(penalties[r])(seq, logits[r : r + 1].clone())[0]
        assert torch.allclose(got[r], want, rtol=0, atol=1e-6), r


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.8), (-1.2, 1.7), (2.0, -2.0)])
def test_presence_and_frequency_follow_openai_formula(presence, frequency):
    rows = 4
    logits, hist = _case(1, rows)
    batch = SamplingBatch.build([SP(presence_penalty=presence, frequency_penalty=frequency)] * rows, [0] * rows)
    got = apply_penalties(logits, batch, hist)
    for r in range(rows):
        output = hist.token_ids[r, hist.prompt_len[r] : hist.total_len[r]].tolist()
        want = _openai_reference(logits[r], output, presence, frequency)
        assert torch.allclose(got[r], want, rtol=0, atol=1e-5), r
        prompt_only = set(hist.token_ids[r, : hist.prompt_len[r]].tolist()) - set(output)
        for tok in prompt_only:  # OpenAI's penalties look at generated tokens only
            assert got[r, tok] == logits[r, tok]


def test_all_three_compose_in_vllm_order():
    logits, hist = _case(2, 1)
    batch = SamplingBatch.build([SP(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)], [0])
    got = apply_penalties(logits, batch, hist)
    seq = hist.token_ids[0, : hist.total_len[0]].unsqueeze(0)
    rep = RepetitionPenaltyLogitsProcessor(1.5)(seq, logits.clone())[0]
    output = hist.token_ids[0, hist.prompt_len[0] : hist.total_len[0]].tolist()
    assert torch.allclose(got[0], _openai_reference(rep, output, 0.3, 0.4), rtol=0, atol=1e-5)


def test_greedy_picks_the_argmax_of_penalised_logits_and_logprobs_stay_raw():
    logits, hist = _case(3, 3)
    top = logits.argmax(dim=-1)
    for r in range(3):  # the unpenalised favourite was generated many times
        hist.token_ids[r, hist.prompt_len[r] : hist.prompt_len[r] + 3] = top[r]
        hist.total_len[r] = max(int(hist.total_len[r]), int(hist.prompt_len[r]) + 3)
    params = [SP(temperature=0.0, frequency_penalty=2.0, logprobs=1)] * 3
    batch = SamplingBatch.build(params, [0] * 3)
    out = sample(logits, batch, hist)
    want = apply_penalties(logits, batch, hist).argmax(dim=-1)
    assert torch.equal(out.token_ids, want) and not torch.equal(want, top)
    raw = logits.log_softmax(dim=-1)
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))


def test_unpenalised_batch_needs_no_history_and_penalised_one_does():
    logits, hist = _case(4, 2)
    plain = SamplingBatch.build([SP(temperature=0.0)] * 2, [0, 0])
    assert plain.penalty_rows is None
    assert torch.equal(sample(logits, plain).token_ids, logits.argmax(dim=-1))
    pen = SamplingBatch.build([SP(temperature=0.0, presence_penalty=1.0)] * 2, [0, 0])
    with pytest.raises(ValueError, match="history"):
        sample(logits, pen)
    with pytest.raises(ValueError, match="penalised rows"):
        apply_penalties(logits, pen, TokenHistory(hist.token_ids[:1], hist.prompt_len[:1], hist.total_len[:1]))
