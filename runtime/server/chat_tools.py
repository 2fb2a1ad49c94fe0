"""One chat request's tool calling: template variables, constraint, reply and stream deltas.

:class:`ToolMode` wraps what :mod:`runtime.server.tools` decides for one request so the chat
handler stays a straight line: ``template_kwargs`` (``tools`` handed to the chat template as
transformers does), ``constraint`` (``required`` / named function), ``reply`` (the non-streamed
message) and ``stream`` (a :class:`ToolStream` turning text increments into OpenAI deltas: content
as it comes, ``tool_calls`` deltas for the calls). Streamed deltas reassemble to the non-streamed
reply: both come from the same parse of the same text.
"""

from __future__ import annotations

from typing import Any

from runtime.sampling_params import StructuredSpec
from runtime.server import responses as R
from runtime.server.errors import APIError
from runtime.server.tools import (Call, StreamSplitter, ToolChoiceError, constraint,
                                  parse_constrained, parser_for)


#: the 400 of a request with ``tools`` (not ``tool_choice: none``) on a template without tools
NO_TOOL_TEMPLATE = ("Unsupported value for 'tools': this server's chat template does not render "
                    "tools (it never reads a 'tools' variable), so the model would not see them. "
                    "Start the server with a tool chat template, e.g. --chat-template hermes (built "
                    "in) or --chat-template FILE, or send tool_choice 'none'.")


class ToolMode:
    """Tool calling of one chat request (inactive without ``tools`` or with ``tool_choice: none``).

    Args:
        req: the ChatCompletionRequest.
        template: the chat template's source (picks the output format of ``auto``).
        template_variables: the variables the template reads (``Tokenizer.chat_template_variables``);
            None when unknown (no check).
    Raises:
        APIError: 400 naming ``tool_choice`` (a forcing choice without tools) or ``tools`` (tools
            in use while the template never reads ``tools``: the model would not see them, and a
            forced call would be made up).
    """

    def __init__(self, req: Any, template: str | None,
                 template_variables: frozenset[str] | None = None) -> None:
        self.tools = req.tools or []
        self.choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        self.active = bool(self.tools) and self.choice != "none"
        self.parallel = req.parallel_tool_calls is not False
        self.parser = parser_for(template)
        if req.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError("Invalid value for 'tool_choice': a tool_choice other than 'none' or "
                           "'auto' needs 'tools'.", param="tool_choice", code="invalid_value")
        if self.active and template_variables is not None and "tools" not in template_variables:
            raise APIError(NO_TOOL_TEMPLATE, param="tools", code="unsupported_value")

    @property
    def constrained(self) -> bool:
        """``required`` or a named function: the output is grammar-constrained JSON."""
        return self.active and self.choice != "auto"

    def template_kwargs(self) -> dict[str, Any]:
        """``{"tools": [...]}`` for the chat template (nothing with ``tool_choice: none``)."""
        if not self.active:
            return {}
        return {"tools": [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in self.tools]}

    def constraint(self) -> tuple[StructuredSpec, str] | None:
        """The JSON-schema constraint of ``required`` / a named function, or None.
        Raises APIError (400 naming the field) for a function not among the tools."""
        if not self.active:
            return None
        try:
            return constraint(self.tools, self.choice, self.parallel)
        except ToolChoiceError as exc:
            raise APIError(f"Invalid value for '{exc.field}': {exc}", param=exc.field,
                           code="invalid_value") from None

    def calls(self, text: str) -> tuple[str | None, list[Call]]:
        """``(content, calls)`` of a whole output."""
        if not self.active:
            return text, []
        if self.constrained:
            try:
                return None, parse_constrained(text, self.choice)
            except (ValueError, KeyError, TypeError):   # cut short by max_tokens: left as text
                return text, []
        content, calls = self.parser.split(text)
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls

    def reply(self, text: str, finish_reason: str) -> tuple[R.AssistantMessage, str]:
        """The non-streamed message and finish reason (``tool_calls`` when calls were made)."""
        content, calls = self.calls(text)
        if not calls:
            return R.AssistantMessage(content=text), finish_reason
        return (R.AssistantMessage(content=content, tool_calls=[c.as_dict() for c in calls]),
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """Text increments -> chat deltas for one streamed request."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.splitter = StreamSplitter(mode.parser) if mode.active and not mode.constrained else None

    def feed(self, piece: str) -> list[R.Delta]:
        """Deltas to send for a new text ``piece`` (content streams; calls wait for the end)."""
        self.text += piece
        if not self.mode.active:
            return [R.Delta(content=piece)] if piece else []
        if self.splitter is not None:
            out = self.splitter.feed(piece)
            return [R.Delta(content=out)] if out else []
        return []     # constrained: the calls are sent whole at the end

    def finish(self, finish_reason: str) -> tuple[list[R.Delta], str]:
        """The last deltas and the finish reason, once the output is complete."""
        if not self.mode.active:
            return [], finish_reason
        if self.splitter is not None:
            rest, calls = self.splitter.finish()
            if not self.mode.parallel:
                calls = calls[:1]
        else:
            content, calls = self.mode.calls(self.text)
            rest = "" if calls else self.text
        deltas = [R.Delta(content=rest)] if rest else []
        for i, c in enumerate(calls):
            deltas.append(R.Delta(tool_calls=[{"index": i, "id": c.id, "type": "function",
                                               "function": {"name": c.name, "arguments": c.arguments}}]))
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason
