"""Incremental detokenization for streaming, with stop strings.

Decoding token by token breaks in two ways: a multi-byte UTF-8 character split across byte-level
tokens decodes to U+FFFD until its last byte arrives, and some decoders change a token's text
depending on its neighbours. Like vLLM / TGI, each step decodes a short window twice, from
`prefix_offset` to `read_offset` (text already emitted) and from `prefix_offset` to the end, and
emits the difference only when the new text does not end in U+FFFD.

Common case without decoding (:attr:`Tokenizer.concat_decode`, byte-level BPE): there a window's
text is the lossy UTF-8 decode of its tokens' bytes joined, so when the prefix window's text has no
U+FFFD (its bytes are valid UTF-8) and the new token's own text has none, the window decode is the
prefix text followed by the token's text and the difference is the token's text, looked up from a
cache (:meth:`Tokenizer.clean_token_texts`). Every other case decodes as above; both give the same
text (tests/runtime/test_detokenizer_fast.py compares them over random token sequences).

Stop strings: the text is cut before the first occurrence of any stop string, which is never
emitted; a tail of the text that could still become a stop string is held back (at most
len(longest stop) - 1 chars), so a stream never emits text it later has to take back.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from runtime.model.tokenizer import REPLACEMENT_CHAR, Tokenizer

# prompt tokens kept as decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a request's output token ids into text chunks, one `push` per engine step.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; its last few tokens give the decoder context so the first
            output token decodes as it would inside the full sequence.
        stop: stop strings (non-empty); the output ends before the first one found.
        skip_special_tokens: leave special tokens (e.g. '<|im_end|>') out of the text.

    Attributes:
        stopped: True once a stop string was found; later pushes return "".
        stop_reason: the stop string that matched, else None.
        output_text: all text emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(stop)
        if any(not s for s in self._stops):
            raise ValueError("stop strings must be non-empty")
        # _ids holds only what later decodes need: the decoded window starts at _ids[_prefix].
        self._ids: list[int] = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text: str | None = None  # decode of the window [_prefix, _read), when known
        # byte-level tokenizers: _clean = the window's text is known and has no U+FFFD (its bytes
        # are valid UTF-8); _fast = _clean and no token waits after the window (_read == len(_ids))
        self._concat = tokenizer.concat_decode
        self._texts = tokenizer.clean_token_texts(skip_special_tokens) if self._concat else {}
        self._clean = self._fast = False
        self._held = ""  # decoded text not yet emitted because it may start a stop string
        self.stopped = False
        self.stop_reason: str | None = None
        self._parts: list[str] = []  # emitted text, joined by output_text when read

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed newly sampled token ids; returns the text that became final (may be "")."""
        if self.stopped:
            return ""
        if self._fast and token_ids.__class__ is list and len(token_ids) == 1:
            tid = token_ids[0]
            text = self._texts[tid]
            if text:  # valid UTF-8 after a valid window: the window's new text is this token's
                ids = self._ids
                if len(ids) == 1:  # the window is the previous token: reuse its list
                    ids[0] = int(tid)
                else:
                    self._ids, self._read = [int(tid)], 1
                self._prefix_text = text
                if not self._stops:
                    self._parts.append(text)
                    return text
                return self._release(text, final=False)
        return self._push_decoding(token_ids)

    def push_counted(self, token_ids: list[int]) -> tuple[str, int]:
        """:meth:`push` for the tokens of one step, saying how many were taken: with stop
        strings, several tokens (speculative decoding: an accepted draft run) are pushed one at
        a time, as a spec-off engine's steps would, and the push ends after the token that
        completes a stop string.

        Returns:
            (text, kept): the text that became final and how many of ``token_ids`` it used
            (``len(token_ids)`` unless a stop string ended inside them).
        """
        if len(token_ids) < 2 or not self._stops:
            return self.push(token_ids), len(token_ids)
        parts = []
        for i, tid in enumerate(token_ids):
            parts.append(self.push([tid]))
            if self.stopped:
                return "".join(parts), i + 1
        return "".join(parts), len(token_ids)

    def _push_decoding(self, token_ids: Iterable[int]) -> str:
        """:meth:`push` by decoding the two windows (see the module docstring)."""
        self._ids.extend(map(int, token_ids))
        prefix_text = self._prefix_text
        if prefix_text is None:  # the window moved since it was last decoded
            prefix_text = self._prefix_text = self._decode(self._prefix, self._read)
            self._clean = self._concat and REPLACEMENT_CHAR not in prefix_text
        new_text = self._decode(self._prefix, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            self._fast = False
            return ""  # nothing new, or an incomplete UTF-8 sequence at the end: wait for more
        delta = new_text[len(prefix_text):]
        self._ids = self._ids[self._read:]  # the emitted window becomes the next prefix
        self._prefix, self._read = 0, len(self._ids)
        if self._clean:  # valid prefix bytes: the new window decodes to exactly the delta
            self._prefix_text = delta
            self._clean = self._fast = REPLACEMENT_CHAR not in delta
        else:
            self._prefix_text, self._fast = None, False
        return self._release(delta, final=False)

    def flush(self) -> str:
        """At the end of the request: the text still held back (a stop-string prefix or an
        incomplete UTF-8 tail, which then decodes with U+FFFD). "" once stopped."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        tail = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._ids = self._ids[self._read:]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text, self._clean, self._fast = None, False, False
        return self._release(tail, final=True)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        if end - start == 1:  # a decode step's prefix window: one token, decoded from a cache
            return self._tok.decode_token(self._ids[start], self._skip)
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _release(self, delta: str, final: bool) -> str:
        """Append `delta` to the held text; return the part that is safe to emit."""
        if not self._stops:  # nothing is ever held back without stop strings
            self._parts.append(delta)
            return delta
        text = self._held + delta
        if self._stops:
            hit = min(((i, k) for k, s in enumerate(self._stops) if (i := text.find(s)) >= 0), default=None)
            if hit is not None:
                self.stopped, self.stop_reason = True, self._stops[hit[1]]
                self._held = ""
                return self._emit(text[:hit[0]])
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return self._emit(text[:len(text) - keep])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, text: str) -> str:
        self._parts.append(text)
        return text
