"""The batched speculative-decoding tensor work (runtime/sampling/speculative_device.py, #33) equals the
row-by-row rules of ppstate/speculative.py on random histories and samples (CPU tensors; the
same torch operations run on CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from ppstate.speculative import propose_ngram, verify_rows
from runtime.sampling.speculative_device import accept_rows, draft_scatter, propose_ngram_rows


def test_batched_proposal_equals_propose_ngram_row_by_row():
    rng = np.random.default_rng(0)
    slots_n, width = 12, 64
    table = torch.as_tensor(rng.integers(0, 4, (slots_n, width)), dtype=torch.int64)  # small vocab: many matches
    for n in (1, 2, 3):
        for k in (0, 1, 4):
            slots = rng.permutation(slots_n)[:9]
            lengths = rng.integers(1, width + 1, 9)
            lengths[0], lengths[1] = 1, n          # histories too short to match
            got = propose_ngram_rows(table, torch.as_tensor(slots), torch.as_tensor(lengths),
                                     int(lengths.max()), n, k)
            assert got.shape == (9, k)
            for i, (s, ln) in enumerate(zip(slots, lengths)):
                want = propose_ngram(table[s, :ln].numpy(), n, k)
                assert got[i].tolist() == want.tolist(), (n, k, s, ln)


def test_batched_acceptance_equals_verify_rows():
    rng = np.random.default_rng(1)
    for k in (1, 2, 4):
        drafts = rng.integers(0, 3, (50, k))
        sampled = rng.integers(0, 3, (50, k + 1))
        sampled[::3, :k] = drafts[::3]               # some rows accept everything
        num_drafts = rng.integers(0, k + 1, 50)
        ns, nr = accept_rows(torch.as_tensor(sampled), torch.as_tensor(drafts),
                             torch.as_tensor(num_drafts))
        want_ns, want_nr = verify_rows(sampled, drafts, num_drafts)
        assert ns.tolist() == want_ns.tolist() and nr.tolist() == want_nr.tolist()


def test_draft_scatter():
    row, j = draft_scatter(np.array([2, 0, 3]))
    assert row.tolist() == [0, 0, 2, 2, 2] and j.tolist() == [0, 1, 0, 1, 2]
