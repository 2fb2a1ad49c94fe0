"""Tokenizer metadata of a GGUF file, and the byte-level BPE `tokenizers.Tokenizer` it describes.

The metadata comes from :func:`runtime.model.gguf_file.read_gguf_metadata` (a fast header
parser). `build_gguf_tokenizer` turns llama.cpp's `tokenizer.ggml.*` keys into a `tokenizers`
object equal to the model's own tokenizer.json: byte-level BPE over the file's tokens and merges,
the pre-tokenizer split that `tokenizer.ggml.pre` names, a ByteLevel decoder, control tokens as
special tokens, and BOS/EOS added when the file's `add_bos_token` / `add_eos_token` flags say so.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from runtime.model.gguf_file import read_gguf_metadata  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GPT-2's split (what `pre_tokenizers.ByteLevel(use_regex=True)` applies).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 / Qwen2.5 / Qwen3: Llama 3's split with single digits (as their tokenizer.json).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> regexes applied in order before the GPT-2 byte mapping (as in llama.cpp's
# llama-vocab.cpp). The "digits first" family isolates every numeric char, like the
# `Digits(individual_digits=True)` step in these models' tokenizer.json.
_DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (GPT2_SPLIT,), "gpt-2": (GPT2_SPLIT,), "gpt2": (GPT2_SPLIT,),
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama3": (LLAMA3_SPLIT,), "llama-bpe": (LLAMA3_SPLIT,), "llama-v3": (LLAMA3_SPLIT,),
    "smaug-bpe": (LLAMA3_SPLIT,), "dbrx": (LLAMA3_SPLIT,), "qwen2": (QWEN2_SPLIT,),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable char map (the spelling of byte-level BPE tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_gguf_tokenizer(meta: dict[str, Any], source: str = "GGUF") -> Tokenizer:
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata (`tokenizer.ggml.model == "gpt2"`).

    Raises: ValueError naming the problem for another tokenizer model type or a missing key.
    """
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{source}: no tokenizer.ggml.model in metadata; cannot build a tokenizer")
    if model != "gpt2":
        raise ValueError(f"{source}: unsupported tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise ValueError(f"{source}: missing tokenizer metadata {key!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    types = np.ones(len(tokens), np.int32) if types is None else np.asarray(types)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte alphabet already; respell the rare one that is not (as HF does).
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        log.warning("%s: unknown tokenizer.ggml.pre %r; using GPT-2's split", source, pre)
    splits = PRE_TOKENIZER_SPLITS.get(pre, PRE_TOKENIZER_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    single, specials = "$A", []
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        single, specials = f"{tokens[bos]} {single}", specials + [(tokens[bos], int(bos))]
    if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None:
        single, specials = f"{single} {tokens[eos]}", specials + [(tokens[eos], int(eos))]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok
