"""Seeded generator of bounded JSON schemas (structured-output tests and `runtime.bench.structured`).

Every schema has a bounded language (strings with ``maxLength``, arrays with ``maxItems``, integers
and numbers with bounds, enums, booleans, nested objects with required fields), so a constrained
output is complete within a small ``max_tokens`` even from a random-weight model.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["id", "name", "kind", "size", "tags", "ok", "note", "pos", "meta", "level", "code", "unit"]


def leaf(rng: random.Random) -> dict[str, Any]:
    """A bounded scalar schema."""
    k = rng.randrange(6)
    if k == 0:
        return {"type": "string", "maxLength": rng.randint(1, 5)}
    if k == 1:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if k == 2:
        return {"type": "boolean"}
    if k == 3:
        return {"enum": rng.sample(["red", "green", "blue", "x y", "q\"uote", "7"], rng.randint(1, 4))}
    if k == 4:
        return {"type": "string", "enum": rng.sample(["a", "bb", "ccc", "d-d"], 2)}
    return {"type": "null"}


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: 1-4 properties, some required, nested up to depth 2."""
    names = rng.sample(WORDS, rng.randint(1, 4))
    props: dict[str, Any] = {}
    for n in names:
        r = rng.random()
        if depth < 2 and r < 0.2:
            props[n] = schema(rng, depth + 1)
        elif r < 0.35:
            props[n] = {"type": "array", "items": leaf(rng), "maxItems": rng.randint(1, 3)}
        else:
            props[n] = leaf(rng)
    required = [n for n in names if rng.random() < 0.6]
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


def schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` schemas from ``seed`` (the same list every run)."""
    rng = random.Random(seed)
    return [schema(rng) for _ in range(n)]


def close_json_prefix(text: str) -> str:
    """``text`` (a prefix of a JSON document, as cut by ``max_tokens``) completed with the
    fewest closing characters: an open string closed, a dangling key given ``null``, open
    arrays / objects closed. ``json.loads`` of the result fails unless ``text`` was a valid
    prefix (an independent check of an unbounded constraint such as ``json_object``)."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            elif ch != "\\":
                esc = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            stack.pop()
    out = text + ('"' if in_str else "")
    if in_str and esc:
        out = text[:-1] + '"'
    tail = out.rstrip()
    if not in_str:
        for word in ("true", "false", "null"):
            for n in range(1, len(word)):
                if tail.endswith(word[:n]) and not tail[:-n][-1:].isalnum():
                    tail, out = tail + word[n:], tail + word[n:]
        if tail[-1:] in "-.eE+" and tail[-2:-1].isdigit() or tail.endswith("-"):
            tail = out = tail + "0"
    if tail.endswith(","):
        out = tail[:-1]
    elif tail.endswith(":"):
        out = tail + " null"
    elif stack and stack[-1] == "}" and tail.endswith('"') and _dangling_key(tail):
        out = tail + ": null"
    return out + "".join(reversed(stack))


def _dangling_key(text: str) -> bool:
    """Whether ``text`` ends with an object key not yet followed by ``:``."""
    i = len(text) - 2
    while i >= 0 and not (text[i] == '"' and text[i - 1] != "\\"):
        i -= 1
    j = i - 1
    while j >= 0 and text[j] in " \n\t":
        j -= 1
    return j >= 0 and text[j] in "{,"
