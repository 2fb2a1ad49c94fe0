"""The incremental detokenizer's cached common case (a byte-level tokenizer, a token whose own text
is complete UTF-8) gives exactly the text of decoding the windows.

Three detokenizers read the same random token streams: the one the engine uses, the same with the
cache turned off (every step decodes the two windows, as before the cache), and an independent
reference written here that decodes both windows from scratch at every push. Streams mix ordinary
tokens, the 256 single-byte tokens (partial UTF-8), special tokens, added tokens and prompts that
end inside a UTF-8 sequence.
"""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import AddedToken

from runtime.model.detokenizer import PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from runtime.model.registry import resolve_model_path
from runtime.model.tokenizer import _BYTE_OF_CHAR, Tokenizer, load_tokenizer

ADDED = ["héllo", "你好", "<tool>"]  # non-special added tokens: Latin-1 (via the byte map), CJK, ASCII


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    base = load_tokenizer(resolve_model_path("default"))
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken(t, special=False) for t in ADDED])
    return Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)


class WindowReference:
    """The window algorithm with nothing kept between pushes but the ids and the two offsets."""

    def __init__(self, tok: Tokenizer, prompt: list[int], skip: bool) -> None:
        self.tok, self.skip = tok, skip
        self.ids = prompt[-PROMPT_CONTEXT_TOKENS:]
        self.prefix, self.read = 0, len(self.ids)

    def _text(self, end: int) -> str:
        return self.tok.decode(self.ids[self.prefix:end], skip_special_tokens=self.skip)

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before, after = self._text(self.read), self._text(len(self.ids))
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        before, after = self._text(self.read), self._text(len(self.ids))
        return after[len(before):] if len(after) > len(before) else ""


def _uncached(tok, prompt, **kw) -> IncrementalDetokenizer:
    det = IncrementalDetokenizer(tok, prompt, **kw)
    det._concat, det._texts = False, {}  # every push decodes (the code before the cache)
    return det


def _pools(tok: Tokenizer) -> list[list[int]]:
    single_bytes = [i for c in _BYTE_OF_CHAR if (i := tok.token_to_id(c)) is not None]
    special = sorted(tok._special)
    added = [tok.token_to_id(t) for t in ADDED]
    literal_fffd = tok.token_to_id("ï¿½")  # the bytes of U+FFFD itself: valid, yet not cached
    text = tok.encode("Sure! 😀👍🏽 你好，世界！ Привет, مرحبا 👨‍👩‍👧 \ufffd done. héllo")
    return [list(range(100, 30000)), single_bytes, special + added + [literal_fffd], text]


def _draw(rng: random.Random, pools: list[list[int]], n: int) -> list[int]:
    weights = [6, 3, 1, 3]
    return [rng.choice(rng.choices(pools, weights)[0]) for _ in range(n)]


def _run(det, stream: list[list[int]]) -> list[str]:
    return [det.push(list(ids)) for ids in stream] + [det.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_cached_common_case_equals_decoding_the_windows(tok, skip):
    assert tok.concat_decode
    rng, pools = random.Random(1234 + skip), _pools(tok)
    fast_steps = 0
    for _ in range(250):
        prompt = _draw(rng, pools, rng.randrange(1, 9))
        out = _draw(rng, pools, rng.randrange(1, 40))
        sizes = [1] * len(out) if rng.random() < 0.7 else [rng.randrange(1, 4) for _ in out]
        stream, i = [], 0
        for k in sizes:
            if i < len(out):
                stream.append(out[i:i + k])
                i += k
        ref = WindowReference(tok, prompt, skip)
        want = [ref.push(ids) for ids in stream] + [ref.flush()]
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        got = []
        for ids in stream:
            fast_steps += det._fast and len(ids) == 1 and bool(det._texts[ids[0]])
            got.append(det.push(ids))
        got.append(det.flush())
        assert got == want == _run(_uncached(tok, prompt, skip_special_tokens=skip), stream), \
            (prompt, stream)
        assert det.output_text == "".join(want)
    assert fast_steps > 500  # the cached case is a common one even in this mix


def test_cached_common_case_equals_decoding_with_stop_strings(tok):
    rng, pools = random.Random(99), _pools(tok)
    for _ in range(200):
        prompt = _draw(rng, pools, rng.randrange(1, 6))
        out = [[t] for t in _draw(rng, pools, 30)]
        text = tok.decode([t for ids in out for t in ids], skip_special_tokens=True)
        a = rng.randrange(len(text) + 1)
        stop = [text[a:a + rng.randrange(1, 6)] or "x", "never-seen"]   # often spans tokens
        det = IncrementalDetokenizer(tok, prompt, stop=stop)
        slow = _uncached(tok, prompt, stop=stop)
        assert _run(det, out) == _run(slow, out), (prompt, out, stop)
        assert (det.stopped, det.stop_reason, det.output_text) == \
            (slow.stopped, slow.stop_reason, slow.output_text)


def test_prompt_ending_inside_a_utf8_sequence_keeps_the_window_semantics(tok):
    emoji = tok.encode("😀")
    assert len(emoji) > 1 and REPLACEMENT_CHAR in tok.decode(emoji[:-1])
    prompt, out = tok.encode("Hi ") + emoji[:-1], [[emoji[-1]], *([t] for t in tok.encode(" ok!"))]
    ref = WindowReference(tok, prompt, True)
    want = [ref.push(ids) for ids in out] + [ref.flush()]
    det = IncrementalDetokenizer(tok, prompt)
    assert _run(det, out) == want
    assert "".join(want) == " ok!"  # the prompt's split emoji is not output text (as before)


def test_a_decoder_that_is_not_byte_level_takes_the_decoding_path():
    vocab = {"[UNK]": 0, "▁he": 1, "llo": 2, "▁wor": 3, "ld": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=None)
    assert not tok.concat_decode
    det = IncrementalDetokenizer(tok, [1])
    assert [det.push([i]) for i in (2, 3, 4)] == ["llo", " wor", "ld"] and not det._fast
