"""Grammars of structured outputs: a request's constraint compiled for one tokenizer, cached.

A request asks for a constraint with a :class:`~runtime.sampling_params.StructuredSpec` (``kind``
and ``value``: a JSON schema, ``json_object``, a regular expression, a list of choices or an EBNF
grammar). :class:`GrammarCompilerCache` turns it into an xgrammar ``CompiledGrammar`` for one
tokenizer and keeps the result, keyed by (tokenizer, kind, value), so the same schema is compiled
once per process. The engine compiles every constrained request before admitting it (in a worker
thread, off the event loop: :meth:`GrammarCompilerCache.compile_async`), so an invalid schema is
an HTTP 400 naming the field with the compiler's reason; the last rank compiles the same spec again
with its own cache when the request is admitted (:mod:`runtime.sampling.grammar_state`).

Why xgrammar: of the well-kept engines (xgrammar, llguidance, outlines-core) it fills a token
bitmask in microseconds for JSON schemas on a 49k vocabulary on the CPU (its adaptive token-mask
cache precomputes most of the mask at compile time), supports JSON schema, regex and EBNF, rolls a
matcher back by any number of tokens (speculative drafts) and applies the bitmask to logits with a
CPU or a Triton kernel. Figures: ``benchmarks/results/structured-cpu-*.json`` and docs/structured.md.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

#: the kinds a :class:`~runtime.sampling_params.StructuredSpec` may name
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: compiled grammars kept per process (least recently used dropped first)
CACHE_ENTRIES = 256


class GrammarError(ValueError):
    """A constraint that cannot be compiled: ``reason`` is the compiler's message."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind}: {reason}")
        self.kind, self.reason = kind, reason


def load_xgrammar():
    """Import xgrammar. Without the optional torch DLPack add-on of its FFI layer: that add-on is
    compiled with a C++ compiler on first import and then loaded while holding the GIL for
    seconds (a rank's heartbeat thread would starve); tensors still cross through DLPack."""
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import xgrammar
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int | None = None) -> "xgr.TokenizerInfo":
    """The xgrammar ``TokenizerInfo`` of a :class:`~runtime.model.tokenizer.Tokenizer`.

    Each id's raw bytes (``tokenizer.token_bytes``) form the vocabulary (xgrammar's RAW type), so
    any tokenizer works, byte-level or not. Args: ``vocab_size``: the model's logit width
    (>= the tokenizer's vocabulary; ids past it are never allowed). Stop ids: the tokenizer's EOS
    ids, the only tokens allowed once the grammar is complete.
    """
    xgr = load_xgrammar()
    n = tokenizer.vocab_size
    vocab = []
    for i in range(n):
        try:
            vocab.append(tokenizer.token_bytes(i))
        except ValueError:   # a hole in the id range
            vocab.append(b"")
    stops = sorted(tokenizer.eos_token_ids) or None
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size or n,
                             stop_token_ids=stops)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (each a string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompilerCache:
    """Compiles :class:`StructuredSpec`s for one tokenizer; thread-safe; an LRU of results.

    Args:
        info: the tokenizer's ``TokenizerInfo`` (:func:`tokenizer_info`).
        key: names the tokenizer in the cache key (e.g. its source path).
        max_threads: threads xgrammar may use inside one compile.
    """

    def __init__(self, info: "xgr.TokenizerInfo", key: str = "", max_threads: int = 2) -> None:
        xgr = load_xgrammar()
        self.info, self.key = info, key
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []   # wall time of each compile that missed the cache

    def compile(self, kind: str, value: str) -> "xgr.CompiledGrammar":
        """The compiled grammar of ``(kind, value)`` (cached).

        Raises:
            GrammarError: unknown kind, or the compiler rejected the constraint (its reason).
        """
        import time
        k = (self.key, kind, value)
        with self._lock:
            hit = self._cache.get(k)
            if hit is not None:
                self._cache.move_to_end(k)
                return hit
        t0 = time.perf_counter()
        compiled = self._compile(kind, value)
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - t0)
            self._cache[k] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, kind: str, value: str) -> "xgr.CompiledGrammar":
        """:meth:`compile` in a worker thread (never on the event loop). Raises as it."""
        import anyio
        return await anyio.to_thread.run_sync(self.compile, kind, value)

    def _compile(self, kind: str, value: str) -> "xgr.CompiledGrammar":
        c = self._compiler
        try:
            if kind == "json_schema":
                json.loads(value)   # a clear message for text that is not JSON at all
                return c.compile_json_schema(value, any_whitespace=False, strict_mode=True)
            if kind == "json_object":   # any JSON object (OpenAI's JSON mode)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "choice":
                choices = json.loads(value)
                if not choices or not all(isinstance(s, str) and s for s in choices):
                    raise ValueError("choices must be a non-empty list of non-empty strings")
                return c.compile_grammar(choice_grammar(choices))
            if kind == "grammar":
                return c.compile_grammar(value)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
            raise GrammarError(kind, _first_line(exc)) from None
        raise GrammarError(kind, f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500]
