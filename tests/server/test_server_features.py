"""Issue 19's logprobs and chat features on a real engine (PP=2 workers), transformers as reference.

* chat ``logprobs``: ``bytes`` are each token's raw bytes (byte-level BPE pieces of an emoji are
  partial UTF-8) and concatenate to the content's bytes;
* legacy ``logprobs: 5``: 5 entries per position even when alternatives decode to the same text,
  the sampled token's entry equals ``token_logprobs``, ``text_offset`` indexes the returned text;
* ``continue_final_message``: the prompt transformers' ``apply_chat_template(continue_final_message=True)``
  builds, and the greedy continuation of it;
* ``repetition_penalty`` / ``presence_penalty`` / ``frequency_penalty``: greedy ids equal a
  transformers greedy loop with ``RepetitionPenaltyLogitsProcessor`` / OpenAI's formula.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from app_harness import CHAT, COMP
from reference import greedy_reference, hf_model

pytestmark = pytest.mark.slow

EMOJI_CHAT = {"model": "default", "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
              "messages": [{"role": "user", "content": "Continue the list: 😀 😁 😂 😃"}]}
EMOJI_COMPLETION = {"model": "default", "prompt": "Emoji list: 😀 😁 😂 😃", "max_tokens": 4,
                    "temperature": 0, "logprobs": 5}


@pytest.fixture(scope="module")
def eng(served_engine):
    return served_engine


def hf_byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


def test_token_bytes_equal_transformers_byte_level_alphabet(eng):
    _, hf = hf_model()
    dec, tok = hf_byte_decoder(), eng.engine.tokenizer
    special = set(hf.all_special_ids)
    pieces = hf.convert_ids_to_tokens(list(range(tok.vocab_size)))
    for i, piece in enumerate(pieces):
        want = piece.encode() if i in special else bytes(dec[c] for c in piece)
        assert tok.token_bytes(i) == want, i


# ---- logprobs ---------------------------------------------------------------------------------
def test_chat_logprob_bytes_rebuild_the_content(eng):
    r = eng.post(CHAT, EMOJI_CHAT)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    ids_r = eng.post(CHAT, {**EMOJI_CHAT, "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = [int(e["token"].removeprefix("token_id:")) for e in ids_r["logprobs"]["content"]]
    tok = eng.engine.tokenizer
    content_entries = [e for e, i in zip(entries, ids) if not tok.is_special(i)]
    rebuilt = b"".join(bytes(e["bytes"]) for e in content_entries)
    content = choice["message"]["content"]
    # exact bytes; an emoji cut by max_tokens ends the content as U+FFFD, as decoding those bytes does
    assert rebuilt.decode("utf-8", errors="replace") == content
    assert rebuilt.startswith(content.rstrip("\ufffd").encode("utf-8"))
    dec = hf_byte_decoder()
    _, hf = hf_model()
    for e, i in zip(entries, ids):  # each token's own bytes, by transformers' alphabet
        piece = hf.convert_ids_to_tokens(i)
        assert bytes(e["bytes"]) == (piece.encode() if i in hf.all_special_ids else bytes(dec[c] for c in piece))
        for alt in e["top_logprobs"]:
            assert alt["bytes"] != [239, 191, 189] or alt["token"] != "\ufffd"
    # the case: some emoji piece is partial UTF-8 (shown as U+FFFD in `token`, not in bytes)
    partial = [e for e in entries if e["token"] == "\ufffd"]
    assert partial and all(e["bytes"] != [239, 191, 189] for e in partial)


def test_legacy_logprobs_5_keep_5_entries_and_index_the_text(eng):
    r = eng.post(COMP, EMOJI_COMPLETION)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    by_id = eng.post(COMP, {**EMOJI_COMPLETION, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in by_id["tokens"]]
    assert len(lp["tokens"]) == len(ids) == 4
    collided = 0
    for pos, (tok_text, tok_lp, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        assert len(top) == 5, top  # greedy: the sampled token is one of the 5
        assert top[tok_text] == tok_lp  # the sampled token's own entry, exactly
        assert sorted(top.values(), reverse=True) == sorted(by_id["top_logprobs"][pos].values(), reverse=True)
        collided += sum(k.startswith("token_id:") for k in top)
    assert collided > 0  # the case: emoji pieces that all decode to U+FFFD
    _, hf = hf_model()
    prompt_ids = hf(EMOJI_COMPLETION["prompt"])["input_ids"]
    assert ids == list(greedy_reference(tuple(prompt_ids), 4))
    for i, off in enumerate(lp["text_offset"]):  # where token i starts, by transformers' decode
        head = hf.decode(ids[:i], skip_special_tokens=True)
        want = len(head.rstrip("\ufffd"))
        assert off == min(want, len(text)), (i, off, want, text)
        assert 0 <= off <= len(text)
    assert lp["text_offset"] == sorted(lp["text_offset"])


# ---- continue_final_message ---------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Name a primary color."}, {"role": "assistant", "content": "The first one is"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."},
     {"role": "assistant", "content": "1, 2, 3, "}],
]


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["two", "trailing-space"])
def test_continue_final_message_matches_transformers(eng, conv):
    _, hf = hf_model()
    want_text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    tok = eng.engine.tokenizer
    assert tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True) == want_text
    want_ids = hf(want_text, add_special_tokens=False)["input_ids"]
    r = eng.post(CHAT, {"messages": conv, "add_generation_prompt": False, "continue_final_message": True,
                        "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
                        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want_ids)
    got = [int(e["token"].removeprefix("token_id:")) for e in body["choices"][0]["logprobs"]["content"]]
    assert got == list(greedy_reference(tuple(want_ids), 6))


def test_without_continue_a_new_assistant_turn_opens(eng):
    conv = CONVERSATIONS[0]
    _, hf = hf_model()
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    r = eng.post(CHAT, {"messages": conv, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(hf(want)["input_ids"])


# ---- penalties ----------------------------------------------------------------------------------
def penalised_greedy(prompt: list[int], n: int, penalise) -> list[int]:
    """Greedy loop over the transformers model; ``penalise(logits [V], prompt, output) -> logits``."""
    from transformers import DynamicCache
    model, _ = hf_model()
    cache, out, ids = DynamicCache(), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
            nxt = int(penalise(logits, prompt, out).argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def _repetition(p: float):
    from transformers import RepetitionPenaltyLogitsProcessor
    proc = RepetitionPenaltyLogitsProcessor(p)
    return lambda logits, prompt, out: proc(torch.tensor([prompt + out]), logits.unsqueeze(0))[0]


def _openai(presence: float, frequency: float):
    def f(logits, prompt, out):
        logits = logits.clone()
        for t, c in Counter(out).items():
            logits[t] -= c * frequency + presence
        return logits
    return f


PENALTIES = [({"repetition_penalty": 1.3}, _repetition(1.3)),
             ({"presence_penalty": 1.5}, _openai(1.5, 0.0)),
             ({"frequency_penalty": 1.0, "presence_penalty": 0.5}, _openai(0.5, 1.0))]


@pytest.mark.parametrize("fields,reference", PENALTIES, ids=["repetition", "presence", "frequency"])
def test_penalised_greedy_equals_transformers(eng, fields, reference):
    _, hf = hf_model()
    prompt = hf("Repeat after me: yes yes yes yes yes")["input_ids"]
    n = 8
    want = penalised_greedy(prompt, n, reference)
    assert want != list(greedy_reference(tuple(prompt), n))  # the penalty changes this output
    r = eng.post(COMP, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                        "logprobs": 0, "return_tokens_as_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    got = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert got == want
