"""Chat templates that replace a model's own (``--chat-template FILE|hermes``).

``hermes``: ChatML (``<|im_start|>role ... <|im_end|>``, the format of SmolLM2, Qwen and Hermes)
extended with tools the way Hermes-style function-calling models are prompted: the tools' JSON
signatures inside ``<tools></tools>`` in the system turn, an instruction to answer a call with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, an assistant turn's ``tool_calls``
rendered as such blocks, and ``tool`` messages given back inside ``<tool_response>`` blocks of a
user turn. With it the embedded SmolLM2 can be served tools (``docs/structured.md``); the tool-call
parser of ``tool_choice: auto`` reads the same blocks.
"""

from __future__ import annotations

from pathlib import Path

from runtime.model.tokenizer import Tokenizer, load_tokenizer

HERMES = """{%- set sys_text = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- if tools -%}
<|im_start|>system
{% if sys_text %}{{ sys_text }}

{% endif %}You can call functions. Their signatures are given as JSON inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a function, answer with one JSON object per call inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <arguments-object>}
</tool_call><|im_end|>
{% elif sys_text %}<|im_start|>system
{{ sys_text }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' and loop.first -%}
{%- elif m['role'] == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ m['content'] }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ m['role'] }}
{% if m['content'] %}{{ m['content'] }}{% endif -%}
{%- if m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] -%}
{%- for call in m['tool_calls'] %}{% if m['content'] or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] | tojson }}}
</tool_call>{% endfor -%}
{%- endif %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

BUILTIN = {"hermes": HERMES}


def resolve_chat_template(name_or_path: str) -> str:
    """The template source of a built-in name (``hermes``) or a Jinja file.

    Raises: FileNotFoundError when it is neither.
    """
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    p = Path(name_or_path)
    if not p.is_file():
        raise FileNotFoundError(f"--chat-template: {name_or_path!r} is neither a built-in template "
                                f"({', '.join(BUILTIN)}) nor a file")
    return p.read_text(encoding="utf-8")


def load_serving_tokenizer(model_path: str | Path, chat_template: str | None) -> Tokenizer:
    """The model's tokenizer with ``--chat-template`` (``EngineConfig.chat_template``) applied.

    The engine and every API server's proxy of it (``--api-server-count``) load their tokenizer
    here, so both render chat prompts (and read tools) with the same template.

    Raises: FileNotFoundError when ``chat_template`` is neither a built-in name nor a file.
    """
    tokenizer = load_tokenizer(model_path)
    if chat_template:
        tokenizer.set_chat_template(resolve_chat_template(chat_template))
    return tokenizer
