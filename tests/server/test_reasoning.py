"""Reasoning parsers (``--reasoning-parser``): whole replies and streams split alike, tags split
across increments never leak into a delta."""

from __future__ import annotations

import pytest

from runtime.server.reasoning import ReasoningStream, split_reasoning

CASES = [
    ("deepseek_r1", "plan it</think>The answer", ("plan it", "The answer")),
    ("deepseek_r1", "<think>plan</think>ok", ("plan", "ok")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("qwen3", "<think>why</think>\n\nbecause", ("why", "\n\nbecause")),
    ("qwen3", "<think>\n\n</think>\n\nhi", ("\n\n", "\n\nhi")),
    ("qwen3", "no thinking here", (None, "no thinking here")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "<thin", (None, "<thin")),
]


@pytest.mark.parametrize("parser,text,want", CASES)
def test_split_whole_reply(parser, text, want):
    assert split_reasoning(parser, text) == want


@pytest.mark.parametrize("parser,text,want", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_stream_equals_whole_reply(parser, text, want, size):
    st, reasoning, content = ReasoningStream(parser), "", ""
    for i in range(0, len(text), size):
        r, c = st.push(text[i:i + size])
        for part in (r, c):
            assert part is None or ("<think>" not in part and "</think>" not in part)
        reasoning, content = reasoning + (r or ""), content + (c or "")
    r, c = st.flush()
    reasoning, content = reasoning + (r or ""), content + (c or "")
    assert (reasoning or None, content or None) == want


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        split_reasoning("nope", "x")
