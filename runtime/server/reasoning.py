"""Reasoning parsers: split a chat reply into ``reasoning_content`` (the ``<think>`` ... ``</think>``
part) and ``content`` (``--reasoning-parser NAME`` of ``runtime.serve``).

* ``deepseek_r1``: DeepSeek-R1's template opens ``<think>`` in the prompt, so the reply starts
  inside the reasoning; everything up to ``</think>`` is reasoning (a leading ``<think>`` is
  dropped), the rest content. A reply without ``</think>`` is all reasoning (it was cut off while
  thinking).
* ``qwen3``: Qwen3 writes ``<think>`` itself (or, with ``chat_template_kwargs:
  {"enable_thinking": false}``, an empty think block or none); reasoning is the text between the
  tags. A reply without ``</think>`` is content when it does not start with ``<think>`` (thinking
  was off), reasoning when it does (cut off while thinking).

:class:`ReasoningStream` does the same on a stream of text increments: a tag split across two
increments is held back until it is complete, so no delta ever carries part of a tag.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole reply; None where a part is empty.

    Raises:
        ValueError: unknown parser name.
    """
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r} (known: {', '.join(PARSERS)})")
    body = text[len(START):] if text.startswith(START) else text
    if END not in body:
        if parser == "deepseek_r1" or text.startswith(START):
            return body or None, None
        return None, text or None
    reasoning, _, content = body.partition(END)
    return reasoning or None, content or None


class ReasoningStream:
    """Incremental :func:`split_reasoning`: ``push(text)`` returns the ``(reasoning, content)``
    deltas of one increment (None where empty); ``flush()`` the held-back rest at the end.

    ``qwen3`` holds text back until it knows whether a think block starts (the reply's first
    characters); ``deepseek_r1`` starts in the reasoning part.
    """

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {', '.join(PARSERS)})")
        self.parser = parser
        self.state = "start"          # start -> reasoning -> content
        self.buf = ""

    def push(self, text: str) -> tuple[str | None, str | None]:
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                if START.startswith(self.buf) and len(self.buf) < len(START):
                    break   # might still become "<think>"
                if self.buf.startswith(START):
                    self.buf = self.buf[len(START):]
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                continue
            if self.state == "reasoning":
                at = self.buf.find(END)
                if at >= 0:
                    reasoning += self.buf[:at]
                    self.buf = self.buf[at + len(END):]
                    self.state = "content"
                    continue
                keep = _partial_suffix(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            content += self.buf
            self.buf = ""
            break
        return reasoning or None, content or None

    def flush(self) -> tuple[str | None, str | None]:
        rest, self.buf = self.buf, ""
        if not rest:
            return None, None
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return rest, None
        return None, rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
