"""Request bodies of structured outputs and tool calling (pydantic, strict, unknown fields refused).

OpenAI's ``response_format`` (``text`` / ``json_object`` / ``json_schema``), ``tools``,
``tool_choice`` and ``parallel_tool_calls``, the ``tool_calls`` of an assistant message in the
history, and vLLM's extensions (``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` and the newer ``structured_outputs`` object). What needs the compiler (is the
schema / regex / grammar valid?) is checked in :mod:`runtime.server.structured`, which names the
field in its 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: OpenAI's rule for function and schema names
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: ``name``, ``schema`` (a JSON schema object), ``strict``."""
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}``."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is only allowed with type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema, object or text),
    ``regex``, ``choice``, ``grammar`` (EBNF) or ``json_object: true``."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of 'json', 'regex', 'choice', 'grammar', "
                             f"'json_object' (got {len(given)})")
        return self


class FunctionDef(_Strict):
    """``tools[i].function``: name, description, ``parameters`` (a JSON schema), strict."""
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools`` (only ``function`` tools exist)."""
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    """``tool_calls[i].function`` of an assistant message: ``arguments`` is JSON text."""
    name: str
    arguments: str


class ToolCall(_Strict):
    """One ``tool_calls`` entry of an assistant message in the history."""
    id: str
    type: Literal["function"]
    function: FunctionCall

    def as_template_dict(self) -> dict[str, Any]:
        """As transformers passes it to a chat template: ``arguments`` parsed into an object
        when it is JSON (templates render it with ``tojson``), the text otherwise."""
        import json
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}
