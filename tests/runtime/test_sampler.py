"""runtime.sampling.sampler against independent references: torch.argmax, numpy log-softmax /
nucleus sets, and empirical frequencies against softmax (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.sampling.batch import SamplingBatch, seeded_uniform
from runtime.sampling.sampler import inverse_cdf, sample, sample_cut
from runtime.sampling_params import SamplingParams as SP

V = 49152  # SmolLM2's vocabulary: exercises the blocked inverse CDF
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _run(logits: torch.Tensor, params: list[SP], index: list[int] | None = None):
    batch = SamplingBatch.build(params, index if index is not None else [0] * len(params), "cpu")
    return sample(logits, batch)


def test_greedy_is_argmax_exactly():
    logits = _logits(16)
    out = _run(logits, [SP(temperature=0.0)] * 16)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = _logits(6)
    params = [SP(temperature=0.0), SP(top_k=20), SP(temperature=0.0, top_p=0.5), SP(), SP(seed=3), SP(temperature=0)]
    out = _run(logits, params)
    ref = logits.argmax(dim=-1)
    for row in (0, 2, 5):
        assert out.token_ids[row].item() == ref[row].item()


def test_top_k_1_is_argmax():
    logits = _logits(12, seed=1)
    for trial in range(3):
        out = _run(logits, [SP(temperature=1.5, top_k=1, seed=trial)] * 6 + [SP(temperature=0.8, top_k=1)] * 6)
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_seeded_sample_independent_of_batch_composition():
    logits = _logits(1, vocab=4096, scale=1.0)  # flat: different uniforms give different tokens
    p = SP(seed=1234, temperature=1.0, top_p=0.95)
    solo = [_run(logits, [p], [i]).token_ids.item() for i in range(8)]
    for i in range(8):
        others = _logits(5, vocab=4096, seed=100 + i, scale=1.0)
        batch_logits = torch.cat([others[:3], logits, others[3:]])
        params = [SP(), SP(temperature=0.0), SP(seed=7, top_k=40), p, SP(top_p=0.5), SP(seed=1234)]
        index = [5, 0, 9, i, 2, i + 1]
        assert _run(batch_logits, params, index).token_ids[3].item() == solo[i]
    assert len(set(solo)) > 1, "every output index drew the same token: the index is not used"
    assert _run(logits, [p], [0]).token_ids.item() == solo[0]  # reproducible


def test_seeded_uniform_is_a_pure_hash():
    assert seeded_uniform(1, 0) == seeded_uniform(1, 0)
    values = {seeded_uniform(s, i) for s in range(20) for i in range(50)}
    assert len(values) == 1000 and all(0.0 <= u < 1.0 for u in values)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_frequencies_match_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]])
    n, temp = 60000, 0.7
    out = _run(logits.expand(n, -1).contiguous(), [SP(temperature=temp)] * n)
    counts = np.bincount(out.token_ids.numpy(), minlength=6)
    x = logits[0].double().numpy()
    target = np.exp(x / temp) / np.exp(x / temp).sum()
    untempered = np.exp(x) / np.exp(x).sum()
    assert _chi2(counts, target) < CHI2_DF5_P001
    assert _chi2(counts, untempered) > 10 * CHI2_DF5_P001  # the test tells temperatures apart


def test_seeded_draws_across_seeds_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, -0.5, 0.2]])
    n = 20000
    out = _run(logits.expand(n, -1).contiguous(), [SP(seed=s) for s in range(n)], [7] * n)
    x = logits[0].double().numpy()
    assert _chi2(np.bincount(out.token_ids.numpy(), minlength=6), np.exp(x) / np.exp(x).sum()) < CHI2_DF5_P001


def _nucleus(logits: np.ndarray, top_p: float) -> set[int]:
    """Reference nucleus: most likely tokens until the mass before a token reaches top_p."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    return {int(t) for t in order[before < top_p]}


def test_top_p_support_is_exact_on_a_hand_made_distribution():
    torch.manual_seed(1)
    probs = np.array([0.5, 0.25, 0.15, 0.06, 0.04] + [0.0] * 995) + 1e-9
    logits = torch.tensor(np.log(probs), dtype=torch.float32).unsqueeze(0)
    n = 8000
    out = _run(logits.expand(n, -1).contiguous(), [SP(top_p=0.8)] * n)
    assert set(out.token_ids.tolist()) == {0, 1, 2} == _nucleus(logits[0].numpy(), 0.8)
    freq = np.bincount(out.token_ids.numpy(), minlength=3)[:3] / n
    assert np.allclose(freq, np.array([0.5, 0.25, 0.15]) / 0.9, atol=0.02)


def test_top_p_wider_than_cpu_candidates_is_exact():
    """~290 tokens in the nucleus: more than the 256 CPU candidates, so the full-vocab redo runs."""
    torch.manual_seed(2)
    vocab = 400
    logits = (-0.002 * torch.arange(vocab, dtype=torch.float32)).unsqueeze(0)
    support = _nucleus(logits[0].numpy(), 0.8)
    assert 256 < len(support) < 320
    drawn: set[int] = set()
    for _ in range(2):
        out = _run(logits.expand(5000, -1).contiguous(), [SP(top_p=0.8)] * 5000)
        drawn |= set(out.token_ids.tolist())
    assert drawn == support


def test_candidate_and_full_vocab_paths_agree():
    scaled = _logits(64, vocab=5000, seed=3, scale=4.0)
    top_k = torch.tensor([0, 50] * 32)
    top_p = torch.tensor([0.9, 0.7, 1.0, 0.95] * 16)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    few = sample_cut(scaled, top_k, top_p, u, num_candidates=256)
    full = sample_cut(scaled, top_k, top_p, u, num_candidates=5000)
    assert torch.equal(few, full)


def test_blocked_inverse_cdf_equals_numpy_searchsorted():
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(200, V, generator=g) ** 8  # uneven, with near-zero mass regions
    probs[:, 1000:3000] = 0.0
    u = torch.rand(200, dtype=torch.float64, generator=g)
    got = inverse_cdf(probs, u).numpy()
    cum = np.cumsum(probs.double().numpy(), axis=1)
    ref = [int(np.searchsorted(c, uu * c[-1], side="right")) for c, uu in zip(cum, u.numpy())]
    assert got.tolist() == ref
    assert not np.any((got >= 1000) & (got < 3000))


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(4, seed=6)
    params = [SP(temperature=0.5, logprobs=5), SP(top_k=3, logprobs=0), SP(temperature=0.0, logprobs=2), SP()]
    out = _run(logits, params)
    x = logits.double().numpy()
    ref = x - x.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    ids = out.token_ids.numpy()
    np.testing.assert_allclose(out.logprobs.numpy(), ref[np.arange(4), ids], rtol=0, atol=2e-5)
    top_ids, top_vals = out.top_logprobs
    assert top_ids.shape == (4, 5)
    np.testing.assert_array_equal(top_ids.numpy(), np.argsort(-ref, axis=1)[:, :5])
    np.testing.assert_allclose(top_vals.numpy(), np.sort(ref, axis=1)[:, ::-1][:, :5], atol=2e-5)


def test_logprobs_zero_gives_no_alternatives():
    out = _run(_logits(2), [SP(logprobs=0), SP()])
    assert out.logprobs is not None and out.logprobs.shape == (2,) and out.top_logprobs is None


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="output indices"):
        SamplingBatch.build([SP()], [0, 1])
    with pytest.raises(ValueError, match="logits shape"):
        sample(_logits(3, vocab=10), SamplingBatch.build([SP()] * 2, [0, 0]))
