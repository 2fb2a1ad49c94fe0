"""Incremental detokenization for streaming, with stop strings.

Decoding token by token breaks in two ways: a multi-byte UTF-8 character split across byte-level
tokens decodes to U+FFFD until its last byte arrives, and some decoders change a token's text
depending on its neighbours. Like vLLM / TGI, each step decodes a short window twice, from
`prefix_offset` to `read_offset` (text already emitted) and from `prefix_offset` to the end, and
emits the difference only when the new text does not end in U+FFFD.

Stop strings: the text is cut before the first occurrence of any stop string, which is never
emitted; a tail of the text that could still become a stop string is held back (at most
len(longest stop) - 1 chars), so a stream never emits text it later has to take back.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from runtime.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
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
        self._held = ""  # decoded text not yet emitted because it may start a stop string
        self.stopped = False
        self.stop_reason: str | None = None
        self._parts: list[str] = []  # emitted text, joined by output_text when read

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed newly sampled token ids; returns the text that became final (may be "")."""
        if self.stopped:
            return ""
        self._ids.extend(map(int, token_ids))
        prefix_text = self._prefix_text
        if prefix_text is None:  # the window moved since it was last decoded
            prefix_text = self._prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete UTF-8 sequence at the end: wait for more
        delta = new_text[len(prefix_text):]
        self._ids = self._ids[self._read:]  # the emitted window becomes the next prefix
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = None
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
        self._prefix_text = None
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
