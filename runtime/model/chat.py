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
import jinja2.meta
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
            #: the variables the template reads from its caller (``messages``, ``tools``, ...)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text for a conversation.

        Args:
            messages: [{"role": "system"|"user"|"assistant"|..., "content": str, ...}, ...].
            add_generation_prompt: append the template's assistant header so the model answers.
            continue_final_message: end the text right after the final message's content, so the
                model continues it (assistant prefill); the rule of transformers'
                ``apply_chat_template(continue_final_message=True)``: render with a marker
                appended to the final content and cut at the marker (also dropping trailing
                whitespace when the template trimmed the content).
            **kwargs: extra template variables (tools, documents, ...), as HF passes them.
        Raises:
            ValueError: the messages are not a list of dicts, rendering failed (the template
                called raise_exception, e.g. roles not alternating, or hit an undefined value),
                both flags are set, or the final message cannot be found in the rendered text.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("chat messages must be a list of dicts with 'role' and 'content'")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt are not compatible")
            return self._render_continued(messages, **kwargs)
        return self._render(messages, add_generation_prompt, **kwargs)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template render failed: {e}") from e
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"chat template render failed: {type(e).__name__}: {e}") from e

    def _render_continued(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with text content")
        if "content" not in self.source:
            raise ValueError("continue_final_message: the chat template does not read 'content'")
        final = messages[-1]["content"]
        marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARK}]
        text = self._render(marked, add_generation_prompt=False, **kwargs)
        mark = _CONTINUE_MARK.strip()
        if final.strip() not in text or mark not in text:
            raise ValueError("continue_final_message: the final message does not appear in the "
                             "rendered chat (the template changed it)")
        at = text.rindex(mark)
        if text[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing whitespace


#: appended to the final message to find where its content ends (the marker transformers uses)
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "
