"""Random-weight Hugging Face model folders written without transformers (fast to make).

:func:`write_random_folder` saves the tensors of :mod:`runtime.bench.gpu_models` (each drawn from a
generator seeded by its name; norms are ones) under their HF names with ``safetensors``, the
shape's ``config.json``, and a tokenizer: ``word`` (``t0`` .. ``tN``, bos ``t1``, eos ``t2``;
prompts go by token id) or ``default`` (the embedded SmolLM2 tokenizer and chat template, real text
in and out; needs a vocabulary of 49152, the ``smollm2-135m`` shape). The engine serves such a
folder with ``--model PATH``. Used by the HTTP-path tests (``tiny`` shape, a folder in well under
a second) and ``benchmarks/device/http.sh`` (SmolLM2 shape with the real tokenizer).

    python -m runtime.bench.model_folder --shape smollm2-135m --tokenizer default --out /tmp/smol
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from runtime.bench.gpu_models import SHAPES, model_config, random_tensor
from runtime.model.tensor_names import stage_tensor_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``t0`` .. ``t{vocab_size-1}`` (bos ``t1``, eos ``t2``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def write_default_tokenizer(path: Path, vocab_size: int) -> None:
    """The embedded model's tokenizer (from its GGUF) with its bos / eos tokens and chat template.

    Raises:
        ValueError: the shape's vocabulary differs from the tokenizer's.
    """
    from runtime.model.registry import default_model_path
    from runtime.model.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    if tok.vocab_size != vocab_size:
        raise ValueError(f"the default tokenizer has {tok.vocab_size} tokens, the shape {vocab_size}")
    tok.backend.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": tok.id_to_token(tok.bos_token_id), "eos_token": tok.id_to_token(tok.eos_token_id),
           "chat_template": tok.chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_random_folder(shape: str, path: str | Path, dtype: str = "float32",
                        tokenizer: str = "word") -> Path:
    """Write the random-weight model of ``shape`` (a key of ``gpu_models.SHAPES``) to ``path``.

    Args:
        dtype: tensor dtype in the safetensors file (``float32``, ``bfloat16``, ``float16``).
        tokenizer: ``word`` or ``default`` (see the module docstring).

    Returns:
        ``path`` (created with its parents).
    """
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_config(shape)
    names = stage_tensor_names(cfg, (0, cfg.num_layers))
    cpu = torch.device("cpu")
    state = {n: random_tensor(cfg, n, cpu, DTYPES[dtype]).contiguous() for n in names}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**SHAPES[shape], "torch_dtype": dtype,
                                                  "bos_token_id": 1, "eos_token_id": 2}))
    vocab = SHAPES[shape]["vocab_size"]
    if tokenizer == "default":
        write_default_tokenizer(path, vocab)
    else:
        write_word_tokenizer(path, vocab)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.model_folder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tokenizer", choices=["word", "default"], default="word")
    p.add_argument("--out", required=True, help="folder to write")
    args = p.parse_args(argv)
    print(write_random_folder(args.shape, args.out, args.dtype, args.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
