"""GGUF checkpoints (llama.cpp format): metadata -> :class:`ModelConfig`, tensors -> fp32 torch.

Tensors are dequantized with ``gguf.quants.dequantize`` one by one, so a stage reads only its own
layers. llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE works on pairs of
adjacent dims; :func:`unpermute_qk` restores the half-split (GPT-NeoX / HF) order, as transformers'
GGUF loader does (``LlamaConverter.reverse_permute_weights``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.model.config import ModelConfig
from runtime.model.errors import ModelError, ModelNotFoundError
from runtime.model.gguf_file import read_gguf_header, tensor_data
from runtime.model.tensor_names import EMBED, FINAL_NORM, LM_HEAD

_GLOBAL_NAMES = {EMBED: "token_embd.weight", FINAL_NORM: "output_norm.weight", LM_HEAD: "output.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight"}
_MAX_DECODED_ARRAY = 64  # metadata arrays longer than this (token lists, merges) are not decoded


def gguf_name(name: str) -> str:
    """llama.cpp tensor name of a canonical (HF) name, e.g. ``blk.3.ffn_up.weight``."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, _, layer, suffix = name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[suffix]}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a Q or K weight ``[n_head * head_dim, in]``.

    llama.cpp stored ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)``; this applies the
    inverse (reshape to ``(n_head, head_dim // 2, 2, in)`` and swap back). Use ``n_kv_head`` for K.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFCheckpoint:
    """A memory-mapped GGUF file (header parsed by :mod:`runtime.model.gguf_file`).

    Raises (constructor):
        ModelNotFoundError: no such file.
        UnsupportedModelError: architecture other than ``llama``.
    """

    def __init__(self, path: Path) -> None:
        if not Path(path).is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        self.path = Path(path)
        header = read_gguf_header(path)
        self.tensors = header.tensors
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        self.metadata = {k: v for k, v in header.metadata.items()
                         if not (isinstance(v, (list, np.ndarray)) and len(v) > _MAX_DECODED_ARRAY)}
        self.config = ModelConfig.from_gguf_fields(
            self.metadata, vocab_size=len(tokens) if tokens is not None else None,
            tied="output.weight" not in self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """Dequantize one tensor (canonical name) to fp32 ``[out, in]`` / ``[n]``.

        Raises:
            ModelError: the tensor is missing from the file (names both names and the file).
        """
        gname = gguf_name(name)
        t = self.tensors.get(gname)
        if t is None:
            raise ModelError(f"{self.path}: tensor {gname!r} (for {name!r}) is missing")
        from gguf.quants import dequantize  # slow import; keep it off the module import path
        w = np.asarray(dequantize(tensor_data(self._mm, t), t.ggml_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, self.config.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, self.config.num_kv_heads)
        return torch.from_numpy(np.array(w, copy=True))

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's ``rope_freqs.weight`` (Llama 3 style scaling stored as per-frequency divisors
        ``[head_dim // 2]``), or None when absent."""
        t = self.tensors.get("rope_freqs.weight")
        return None if t is None else torch.from_numpy(
            np.array(tensor_data(self._mm, t), dtype=np.float32))
