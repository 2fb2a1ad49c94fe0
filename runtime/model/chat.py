"""Chat templates: render a model's own Jinja chat template the way Hugging Face does.

The template comes from the model (GGUF `tokenizer.chat_template` or tokenizer_config.json /
chat_template.jinja) and is untrusted code, so it runs in jinja2's `ImmutableSandboxedEnvironment`
with the same options and helpers as `transformers.apply_chat_template` (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, and the
`{% generation %}` block rendered as plain text), so the rendered prompt is byte-identical to it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text.
        special_tokens: variables the template may use besides `messages`, e.g.
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}.
    Raises:
        ValueError: the template does not compile (syntax error), with jinja's message.
    """

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for a conversation.

        Args:
            messages: [{"role": "system"|"user"|"assistant"|..., "content": str, ...}, ...].
            add_generation_prompt: append the template's assistant header so the model answers.
            **kwargs: extra template variables (tools, documents, ...), as HF passes them.
        Raises:
            ValueError: the messages are not a list of dicts, or rendering failed (the template
                called raise_exception, e.g. roles not alternating, or hit an undefined value).
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("chat messages must be a list of dicts with 'role' and 'content'")
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template render failed: {e}") from e
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"chat template render failed: {type(e).__name__}: {e}") from e
