"""StageModel on the real SmolLM2 GGUF against transformers loading the same file
(tests/helpers/reference.py): logits, greedy continuations, pipeline cuts, chunked prefill and mixed
prefill/decode batches."""

from __future__ import annotations

import pytest
import torch

from reference import greedy_reference, hf_model
from runtime.model.batch_meta import BatchMeta

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
CHATS = ["What is 2+2?", "Name three colors of the rainbow."]
NEW_TOKENS = 32


def run(stages, slots, starts, query_lens, ids):
    """One step through all stages in order -> last-stage fp32 logits [R, V]."""
    meta = BatchMeta.build(torch.tensor(slots), torch.tensor(starts), torch.tensor(query_lens))
    hidden, residual = None, None
    for st in stages:
        if st.is_first:
            out = st(meta, input_ids=torch.tensor(ids))
        else:
            out = st(meta, hidden=hidden, residual=residual)
        if not st.is_last:
            hidden, residual = out
    return out


def greedy(stages, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prefill all prompts in one batch (slot i = prompt i), then decode them together for n tokens."""
    logits = run(stages, list(range(len(prompts))), [0] * len(prompts), [len(p) for p in prompts],
                 [t for p in prompts for t in p])
    out = [[t] for t in logits.argmax(-1).tolist()]
    for step in range(n - 1):
        starts = [len(p) + step for p in prompts]
        logits = run(stages, list(range(len(prompts))), starts, [1] * len(prompts), [o[-1] for o in out])
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Workers run one torch thread; batch invariance (exact chunk/mixed equality) assumes it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def encode(tok, text: str) -> list[int]:
    return tok(text).input_ids


def chat(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])


def test_last_position_logits_match_transformers(hf, make_stages):
    model, tok = hf
    prompts = [encode(tok, p) for p in PROMPTS]
    ours = run(make_stages([(0, 30)]), [2, 0, 5], [0, 0, 0], [len(p) for p in prompts],
               [t for p in prompts for t in p])
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert ours.dtype == torch.float32 and ours.shape == (3, 49152)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_matches_transformers_raw_and_chat(hf, make_stages):
    _, tok = hf
    prompts = [encode(tok, p) for p in PROMPTS] + [chat(tok, c) for c in CHATS]
    assert 2 in prompts[-1]  # EOS id inside chat prompts (the attention-mask trap)
    ours = greedy(make_stages([(0, 30)]), prompts, NEW_TOKENS)
    for p, got in zip(prompts, ours):
        assert tuple(got) == greedy_reference(tuple(p), NEW_TOKENS)


@pytest.mark.parametrize("ranges", [[(0, 19), (19, 30)], [(0, 13), (13, 25), (25, 30)]])
def test_pipeline_cuts_give_identical_tokens(hf, make_stages, ranges):
    _, tok = hf
    prompts = [encode(tok, PROMPTS[0]), chat(tok, CHATS[0])]
    stages = make_stages(ranges)
    assert [(s.is_first, s.is_last) for s in stages][0] == (True, False)
    assert stages[-1].is_last and not stages[-1].is_first
    ours = greedy(stages, prompts, NEW_TOKENS)
    for p, got in zip(prompts, ours):
        assert tuple(got) == greedy_reference(tuple(p), NEW_TOKENS)
    whole = run(make_stages([(0, 30)]), [0], [0], [len(prompts[1])], prompts[1])
    split = run(make_stages(ranges), [0], [0], [len(prompts[1])], prompts[1])
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=0)


def test_chunked_prefill_equals_whole_prompt(hf, make_stages):
    _, tok = hf
    prompt = chat(tok, "Explain in one sentence why the sky is blue.")
    stages = make_stages([(0, 30)])
    whole = run(stages, [1], [0], [len(prompt)], prompt)
    chunked = make_stages([(0, 30)])
    for start in range(0, len(prompt), 7):
        piece = prompt[start:start + 7]
        last = run(chunked, [4], [start], [len(piece)], piece)
    torch.testing.assert_close(last, whole, atol=1e-5, rtol=0)
    nxt = int(whole.argmax())  # the caches agree too: one decode step on each
    torch.testing.assert_close(run(chunked, [4], [len(prompt)], [1], [nxt]),
                               run(stages, [1], [len(prompt)], [1], [nxt]), atol=1e-5, rtol=0)


def test_mixed_batch_equals_each_request_alone(hf, make_stages):
    _, tok = hf
    texts = PROMPTS + CHATS
    p = [encode(tok, t) for t in texts[:3]] + [chat(tok, c) for c in texts[3:]]
    # three decodes (slots 6, 1, 3), a fresh prefill (slot 5), a second prefill chunk (slot 0)
    batched = make_stages([(0, 19), (19, 30)])
    for slot, ids in zip((6, 1, 3), p[:3]):
        run(batched, [slot], [0], [len(ids)], ids)
    run(batched, [0], [0], [5], p[4][:5])
    rows = [(6, len(p[0]), [11]), (5, 0, p[3]), (1, len(p[1]), [7]), (0, 5, p[4][5:]), (3, len(p[2]), [9])]
    mixed = run(batched, [r[0] for r in rows], [r[1] for r in rows], [len(r[2]) for r in rows],
                [t for r in rows for t in r[2]])
    history = {6: p[0], 5: [], 1: p[1], 0: p[4][:5], 3: p[2]}
    alone = make_stages([(0, 30)])  # one request per step; slots never interact
    for i, (slot, start, ids) in enumerate(rows):
        if start:
            run(alone, [slot], [0], [start], history[slot])
        torch.testing.assert_close(mixed[i], run(alone, [slot], [start], [len(ids)], ids)[0],
                                   atol=1e-5, rtol=0)
