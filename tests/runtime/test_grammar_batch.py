"""The batched grammar step (one ``BatchGrammarMatcher`` fill and accept for all rows) against the
row-by-row reference: equal bitmasks and accepted counts at every step of a random walk through
bounded strings, numbers, enums, completed grammars (stop row) and drafts; refusals named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

from runtime.bench.grammar_micro import ROWS_SCHEMA  # noqa: E402
from runtime.model.registry import resolve_model_path  # noqa: E402
from runtime.model.tokenizer import load_tokenizer  # noqa: E402
from runtime.sampling.grammar import GrammarCompilerCache, tokenizer_info  # noqa: E402
from runtime.sampling.grammar_state import GrammarState, GrammarViolation  # noqa: E402

SPECS = [{"kind": "json_schema", "value": json.dumps(ROWS_SCHEMA)},
         {"kind": "choice", "value": json.dumps(["yes", "no"])},   # completes in 1-2 tokens
         {"kind": "regex", "value": "[a-z]{2,6}-[0-9]{1,3}"},
         {"kind": "json_object", "value": ""}]
ROWS = 8


@pytest.fixture(scope="module")
def cache():
    return GrammarCompilerCache(tokenizer_info(load_tokenizer(resolve_model_path("default"))), "t")


def _states(cache, threads):
    g = GrammarState(cache, ROWS + 2, threads=threads)
    for s in range(ROWS):
        g.admit(s + 1, SPECS[s % len(SPECS)], [])   # slots 1..ROWS; slot 0 unconstrained
    return g


def _allowed(row: torch.Tensor, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab])


def test_batched_fill_and_accept_equal_the_row_by_row_reference(cache):
    ref, bat = _states(cache, 1), _states(cache, 2)
    rng = np.random.default_rng(7)
    stops = set(cache.info.stop_token_ids)
    # logit row i + 1 belongs to slot i + 1; row 0 (slot 0) is unconstrained and stays all ones
    layout = [(s, s, []) for s in range(1, ROWS + 1)]
    saw_stop_row = False
    for step in range(16):
        want = ref._fill_rowwise(torch.full((ROWS + 1, ref.words), -1, dtype=torch.int32), layout)
        fill = bat.start_fill(ROWS + 1, [(0, 0, [])] + layout)
        assert fill.rows == list(range(1, ROWS + 1))
        got = fill.future.result()
        assert torch.equal(got, want), f"step {step}"
        assert (got[0] == -1).all()
        toks = []
        for s in range(1, ROWS + 1):
            ok = _allowed(got[s], ref.vocab_size)
            saw_stop_row |= set(ok.tolist()) <= stops
            no_stop = [t for t in ok if t not in stops]   # keep going past the grammar's end
            toks.append(int(rng.choice(no_stop or ok)))
        for s, t in zip(range(1, ROWS + 1), toks):
            ref.accept(s, [t])
        bat.accept_batch(list(range(1, ROWS + 1)), toks)
        assert bat.num_accepted.tolist() == ref.num_accepted.tolist() == [0] + [step + 1] * ROWS + [0]
    assert saw_stop_row                                  # the choice rows completed
    # drafts: the row-by-row path inside the batched fill, next to batched rows
    d = [(1, 1, [int(toks[0])]), (2, 3, [])]
    want = ref._fill_rowwise(torch.full((4, ref.words), -1, dtype=torch.int32), d)
    fill = bat.start_fill(4, d)
    assert fill.rows == [1, 2, 3] and torch.equal(fill.future.result(), want)
    ref.close(), bat.close()


def test_a_refused_token_names_its_slot(cache):
    g = GrammarState(cache, 4, threads=2)
    g.admit(2, {"kind": "regex", "value": "[0-9]+"}, [])
    g.admit(3, {"kind": "regex", "value": "[a-z]+"}, [])
    digit, letter = cache.info.decoded_vocab.index(b"7"), cache.info.decoded_vocab.index(b"q")
    g.accept_batch([2, 3], [digit, letter])
    assert g.num_accepted.tolist() == [0, 0, 1, 1]
    with pytest.raises(GrammarViolation, match="slot 3: emitted token"):
        g.accept_batch([2, 3], [digit, digit])
    g.close()
