"""Tool calling: the constraint of ``tool_choice``, and model output parsed into ``tool_calls``.

``tool_choice``:

* ``none`` (or no ``tools``): plain text, nothing parsed.
* ``auto``: the model decides; its output is parsed by the family's format (below); text outside
  the calls stays ``content``.
* ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` objects,
  one ``anyOf`` branch per tool (``name`` a constant, ``arguments`` the tool's ``parameters``
  schema); at most one item when ``parallel_tool_calls`` is false. It always parses.
* a named function: the output is constrained to that function's ``parameters`` schema: it *is*
  the arguments.

Formats of ``auto`` (the parser is picked from the chat template's text, :func:`parser_for`):
Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call),
Llama 3.x JSON ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``,
calls separated by ``;``), Mistral ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling_params import StructuredSpec

#: accepted when a tool has no ``parameters``: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class Call:
    """One parsed tool call: ``arguments`` is JSON text (as OpenAI returns it)."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required``: an array of calls of the given tools."""
    branches = [{"type": "object",
                 "properties": {"name": {"const": t.function.name},
                                "arguments": t.function.parameters or ANY_OBJECT},
                 "required": ["name", "arguments"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constraint(tools: list[Any] | None, choice: Any, parallel: bool) -> tuple[StructuredSpec, str] | None:
    """The constraint ``tool_choice`` implies and its field, or None (``none`` / ``auto``).

    Raises:
        ValueError: ``(field, message)``-style: a named function that is not in ``tools``, or
            ``required`` / a named function without ``tools``; the message names the field.
    """
    if choice is None or choice in ("none", "auto"):
        return None
    if not tools:
        raise ToolChoiceError("tool_choice", f"tool_choice {_name(choice)!r} needs 'tools'")
    if choice == "required":
        return (StructuredSpec(kind="json_schema", value=json.dumps(required_schema(tools, parallel))),
                "tools")
    by_name = {t.function.name: t for t in tools}
    tool = by_name.get(choice.function.name)
    if tool is None:
        raise ToolChoiceError("tool_choice.function.name",
                              f"tool_choice names the function {choice.function.name!r}, which is "
                              f"not among the tools ({', '.join(by_name)})")
    params = tool.function.parameters or ANY_OBJECT
    return StructuredSpec(kind="json_schema", value=json.dumps(params)), "tools"


class ToolChoiceError(ValueError):
    """A ``tool_choice`` that cannot be served: ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _name(choice: Any) -> str:
    return choice if isinstance(choice, str) else choice.function.name


# ---- output -> calls ----------------------------------------------------------------------------
def parse_constrained(text: str, choice: Any) -> list[Call]:
    """Calls of a ``required`` (a JSON array) or named-function (the arguments) output.
    Raises ValueError when the text is not complete JSON (e.g. cut by max_tokens)."""
    if choice == "required":
        return [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in json.loads(text)]
    json.loads(text)
    return [Call(choice.function.name, text)]


class ToolParser:
    """Finds tool calls in free (``auto``) output. ``start``: the text that opens the calls."""
    start = "<tool_call>"

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        """``(content, calls)``; no calls (and ``text`` as content) when nothing parses."""
        raise NotImplementedError

    def opening(self, pending: str, at_start: bool) -> tuple[int | None, int]:
        """Where calls may open in ``pending`` (text not yet sent; ``at_start``: nothing was sent
        before it): ``(index of the opening or None, characters at the end to hold back)``."""
        at = pending.find(self.start)
        if at >= 0:
            return at, 0
        return None, _partial_suffix(pending, self.start)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5/3)."""
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]):
            obj = _loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(Call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        content = text[:at].rstrip()
        return (content or None), calls


class Llama3Parser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, the whole output
    (optionally after ``<|python_tag|>``) (Llama 3.1 / 3.2 / 3.3 JSON tool calling)."""
    start = "{"
    _tag = "<|python_tag|>"

    def opening(self, pending: str, at_start: bool) -> tuple[int | None, int]:
        if not at_start:          # calls are the whole output: once text went out, none follow
            return None, 0
        body = pending.lstrip()
        if body.startswith("{") or body.startswith(self._tag):
            return 0, 0
        if self._tag.startswith(body):   # empty so far, or the tag's beginning
            return None, len(pending)
        return None, 0

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(Call(obj["name"], json.dumps(args, ensure_ascii=False)))
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls


class MistralParser(ToolParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 tokenizers)."""
    start = "[TOOL_CALLS]"

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        arr = _loads(text[at + len(self.start):].strip())
        if isinstance(arr, dict):
            arr = [arr]
        if not isinstance(arr, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                for c in arr):
            return text, []
        content = text[:at].rstrip()
        return (content or None), [Call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False))
                                   for c in arr]


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return None


def parser_for(template: str | None) -> ToolParser:
    """The format the chat template teaches: Mistral's ``[TOOL_CALLS]``, Llama 3's
    ``<|python_tag|>`` / ``ipython``, else Hermes ``<tool_call>``."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<tool_call>" in t:
        return HermesParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3Parser()
    return HermesParser()


class StreamSplitter:
    """Streams ``auto`` output as content until the parser's start text appears, then holds the
    rest back for :meth:`finish` (text that may be the start's beginning is held too)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""          # everything so far
        self.sent = 0           # characters already sent as content
        self.holding = False

    def feed(self, piece: str) -> str:
        """Content to send now for the new ``piece``."""
        self.text += piece
        if self.holding:
            return ""
        pending = self.text[self.sent:]
        at, keep = self.parser.opening(pending, self.sent == 0)
        if at is not None:
            self.holding = True
            out = pending[:at].rstrip()
            self.sent += len(out)
            return out
        out = pending[:len(pending) - keep].rstrip()   # trailing whitespace waits: a call after
        self.sent += len(out)                         # it drops it from the content
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """``(content not yet sent, calls)`` at the end of the output."""
        content, calls = self.parser.split(self.text)
        if not calls:
            return self.text[self.sent:], []
        rest = (content or "")[self.sent:] if content and len(content) > self.sent else ""
        return rest, calls


def _partial_suffix(text: str, start: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``start``."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if text.endswith(start[:n]):
            return n
    return 0
