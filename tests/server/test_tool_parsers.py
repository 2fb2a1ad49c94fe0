"""Tool-call parsers and the streaming splitter (no server): each family's format, text around
the calls, malformed output left as text, and streamed content + calls equal to the whole parse
whatever the chunking."""

from __future__ import annotations

import json

import pytest

from runtime.server.tools import (HermesParser, Llama3Parser, MistralParser, StreamSplitter,
                                  parser_for, required_schema)

CASES = [
    (HermesParser(), 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
     "Sure.", [("add", {"a": 1})]),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
     '"arguments": {"x": [1, "é"]}}</tool_call>', None, [("f", {}), ("g", {"x": [1, "é"]})]),
    (HermesParser(), "no call here", "no call here", []),
    (HermesParser(), "a <tool_call> {broken", "a <tool_call> {broken", []),
    (Llama3Parser(), '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    (Llama3Parser(), '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    (Llama3Parser(), "The answer is 4.", "The answer is 4.", []),
    (MistralParser(), 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"y": 2}}, {"name": "h", "arguments": {}}]',
     "ok", [("f", {"y": 2}), ("h", {})]),
    (MistralParser(), "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_parse_and_stream_agree(parser, text, content, calls, chunk):
    got_content, got = parser.split(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    s = StreamSplitter(parser)
    sent = "".join(s.feed(text[i:i + chunk]) for i in range(0, len(text), chunk))
    rest, streamed = s.finish()
    assert sent + rest == (content or "")
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in got]


def test_parser_follows_the_template():
    assert isinstance(parser_for("... [TOOL_CALLS] ..."), MistralParser)
    assert isinstance(parser_for("<|python_tag|>{{ x }}"), Llama3Parser)
    assert isinstance(parser_for("<tool_call>"), HermesParser)
    assert isinstance(parser_for(None), HermesParser)


def test_required_schema_is_one_branch_per_tool():
    class F:
        def __init__(self, name, params):
            self.function = type("Fn", (), {"name": name, "parameters": params})
    s = required_schema([F("a", {"type": "object", "properties": {"x": {"type": "integer"}}}), F("b", None)],
                        parallel=False)
    import jsonschema
    jsonschema.validate([{"name": "a", "arguments": {"x": 1}}], s)
    jsonschema.validate([{"name": "b", "arguments": {"anything": True}}], s)
    for bad in ([], [{"name": "c", "arguments": {}}], [{"name": "a", "arguments": {"x": "s"}}],
                [{"name": "b", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
