"""Request sets for ``python -m runtime.bench serve``: random token ids, or prompts from a file.

A :class:`BenchRequest` is one prompt (token ids or text) and the new tokens to ask for.

* ``random``: ``--input-len`` random token ids (100..39999) per prompt and ``--output-len`` new
  tokens each, reproducible from ``--seed``.
* a ``.json`` / ``.jsonl`` file: a real length distribution. Each entry is one of
  ``{"prompt": "...", "output_len": N}`` (``output_len`` or ``max_tokens`` optional),
  ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}`` (OpenAI
  style) or ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
  (ShareGPT). The prompt is the first user turn; the output length is the token count of the
  first reply after it (with the given tokenizer), else ``output_len`` / ``max_tokens``, else
  ``--output-len``. As ``vllm bench serve`` does with ShareGPT, entries are shuffled with
  ``--seed``; prompts or replies under 4 tokens and entries whose prompt + output exceed
  ``--max-model-len`` are skipped; the first ``--num-prompts`` left are used (fewer if the file
  holds fewer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_TOKENS = 4


@dataclass
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt: token ids or text, sent as the completion's ``prompt``.
        prompt_len: prompt tokens (as this client's tokenizer counts them; the server's usage
            block overrides it in the results).
        output_len: ``max_tokens`` asked for (EOS is ignored, so exactly this many come back).
    """
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (100..39999), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """The ``random`` dataset."""
    return [BenchRequest(p, input_len, output_len) for p in random_prompts(n, input_len, seed)]


def read_entries(path: Path) -> list[dict]:
    """The entries of a ``.json`` list (or ``{"data": [...]}``) or of a ``.jsonl`` file.

    Raises:
        ValueError: not a list of JSON objects (names the file and the line for JSONL).
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{i}: not JSON: {exc}") from None
        entries = out
    else:
        doc = json.loads(text)
        entries = doc.get("data") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: expected a list of JSON objects")
    return entries


def _turns(entry: dict) -> list[tuple[str, str]]:
    """(role, text) of each turn: ``user`` / ``assistant`` for both conversation spellings."""
    if isinstance(entry.get("messages"), list):
        return [(str(m.get("role")), _text(m.get("content"))) for m in entry["messages"]
                if isinstance(m, dict)]
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
    return [(roles.get(str(m.get("from")), str(m.get("from"))), _text(m.get("value")))
            for m in entry.get("conversations") or [] if isinstance(m, dict)]


def _text(content: Any) -> str:
    if isinstance(content, list):   # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def prompt_and_reply(entry: dict) -> tuple[str, str | None, int | None]:
    """(prompt text, reply text or None, explicit output length or None) of one entry."""
    explicit = entry.get("output_len", entry.get("max_tokens"))
    explicit = int(explicit) if isinstance(explicit, int) and explicit > 0 else None
    if isinstance(entry.get("prompt"), str):
        return entry["prompt"], None, explicit
    turns = _turns(entry)
    for i, (role, text) in enumerate(turns):
        if role == "user" and text:
            reply = next((t for r, t in turns[i + 1:] if r == "assistant"), None)
            return text, reply, explicit
    return "", None, explicit


def file_requests(path: str | Path, n: int, count_tokens: Callable[[str], int], output_len: int,
                  max_model_len: int, seed: int) -> list[BenchRequest]:
    """Up to ``n`` requests from a JSON / JSONL file (module docstring)."""
    entries = read_entries(Path(path))
    random.Random(seed).shuffle(entries)
    return list(_take(entries, n, count_tokens, output_len, max_model_len))


def _take(entries: list[dict], n: int, count_tokens: Callable[[str], int], output_len: int,
          max_model_len: int) -> Iterator[BenchRequest]:
    taken = 0
    for entry in entries:
        if taken >= n:
            return
        prompt, reply, explicit = prompt_and_reply(entry)
        if not prompt:
            continue
        p_len = count_tokens(prompt)
        out_len = explicit or (count_tokens(reply) if reply else output_len)
        if p_len < MIN_TOKENS or out_len < MIN_TOKENS or p_len + out_len > max_model_len:
            continue
        taken += 1
        yield BenchRequest(prompt, p_len, out_len)
