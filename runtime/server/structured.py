"""From a request's structured-output fields to the one constraint the engine enforces.

A request may name at most one constraint: ``response_format`` (``json_object`` or
``json_schema``), vLLM's ``structured_outputs`` object or one of its ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields, or (chat) a ``tool_choice`` of
``required`` or a named function, which this module turns into a JSON schema
(:mod:`runtime.server.tools`). :meth:`StructuredCompiler.check` compiles the constraint with the
served tokenizer in a worker thread (cached per constraint): a constraint the compiler refuses is
an HTTP 400 naming the field and quoting the compiler's reason, before the engine sees the
request, so one request's bad grammar never reaches the ranks or another request.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import anyio

from runtime.sampling_params import StructuredSpec
from runtime.server.errors import APIError

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # "[14:04:06] /project/cpp/x.cc:83: "


def requested(req: Any) -> tuple[StructuredSpec, str] | None:
    """The request's constraint and the field that asked for it, or None.

    Raises:
        APIError: 400 when more than one field asks for a constraint, or a schema is missing.
    """
    found: list[tuple[StructuredSpec, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredSpec(kind="json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema.schema_ is None:
            raise APIError("Missing required parameter: 'response_format.json_schema.schema'.",
                           param="response_format.json_schema.schema",
                           code="missing_required_parameter")
        found.append((StructuredSpec(kind="json_schema", value=json.dumps(rf.json_schema.schema_)),
                      "response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        found.append(_from_structured_outputs(so))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        v = getattr(req, field)
        if v is not None:
            found.append((StructuredSpec(kind=kind, value=_text(kind, v)), field))
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise APIError(f"Only one structured-output constraint per request; got {names}.",
                       param=found[1][1], code="invalid_value")
    return found[0] if found else None


def _from_structured_outputs(so: Any) -> tuple[StructuredSpec, str]:
    if so.json_object:
        return StructuredSpec(kind="json_object"), "structured_outputs.json_object"
    for attr, kind, name in (("json_", "json_schema", "json"), ("regex", "regex", "regex"),
                             ("choice", "choice", "choice"), ("grammar", "grammar", "grammar")):
        v = getattr(so, attr)
        if v is not None:
            return StructuredSpec(kind=kind, value=_text(kind, v)), f"structured_outputs.{name}"
    raise AssertionError("StructuredOutputs validated exactly one field")


def _text(kind: str, v: Any) -> str:
    """The constraint's source text: a schema object as JSON, choices as a JSON list."""
    if kind in ("json_schema", "choice") and not isinstance(v, str):
        return json.dumps(v)
    return v


class StructuredCompiler:
    """The engine process's grammar cache for the served tokenizer.

    xgrammar and the tokenizer's vocabulary load on first use (a few seconds), in a worker
    thread; :meth:`warm` starts that in the background at server start.
    """

    def __init__(self, tokenizer: Any, on_first_use: Any = None) -> None:
        self.tokenizer = tokenizer
        self._on_first_use = on_first_use   # e.g. the engine's warm_grammar (the last rank)
        self._cache = None
        self._lock = threading.Lock()

    def cache(self):
        """The :class:`~runtime.sampling.grammar.GrammarCompilerCache` (built once)."""
        with self._lock:
            if self._cache is None:
                from runtime.sampling.grammar import GrammarCompilerCache, tokenizer_info
                tok = self.tokenizer
                self._cache = GrammarCompilerCache(tokenizer_info(tok), str(getattr(tok, "source", "")))
            return self._cache

    def warm(self) -> None:
        """Build the cache in a daemon thread (errors surface on the first request)."""
        def run() -> None:
            try:
                self.cache()
            except Exception:  # noqa: BLE001 - reported when a request needs it
                pass
        threading.Thread(target=run, name="grammar-warm", daemon=True).start()

    async def check(self, spec: StructuredSpec, field: str) -> None:
        """Compile ``spec`` off the event loop.

        Raises:
            APIError: 400 naming ``field`` with the compiler's reason.
        """
        from runtime.sampling.grammar import GrammarError
        if self._on_first_use is not None:   # on the event loop (the engine's sockets live there)
            first, self._on_first_use = self._on_first_use, None
            first()
        try:
            cache = await anyio.to_thread.run_sync(self.cache)
            await cache.compile_async(spec.kind, spec.value)
        except GrammarError as exc:
            reason = _LOG_PREFIX.sub("", exc.reason)
            raise APIError(f"Invalid value for '{field}': the {exc.kind} cannot be compiled: "
                           f"{reason}", param=field, code="invalid_value") from None
