"""GGUF checkpoints (llama.cpp format): metadata -> :class:`ModelConfig`, tensors -> fp32 torch.

Architectures: those a family declares under ``gguf.architectures`` (``llama``, ``qwen2``,
``qwen3``, ``qwen3moe``). Tensor names are gguf-py's (``gguf.TENSOR_NAMES``): ``blk.N.attn_q``,
``attn_q.bias``, ``attn_q_norm``, ``ffn_gate_inp`` (router), ``ffn_{gate,up,down}_exps`` (experts
stacked ``[E, out, in]``, the canonical stacked layout). Tensors are dequantized with
``gguf.quants.dequantize`` one by one, so a stage reads only its own layers. For the ``llama``
architecture llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE works on
pairs of adjacent dims; :func:`unpermute_qk` restores the half-split (GPT-NeoX / HF) order, as
transformers' GGUF loader does (``LlamaConverter.reverse_permute_weights``). The Qwen converters
do not permute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.model.config import ModelConfig
from runtime.model.errors import ModelError, ModelNotFoundError
from runtime.model.gguf_file import read_gguf_header, tensor_data
from runtime.model.families.family import family_for_gguf
from runtime.model.tensor_names import EMBED, FINAL_NORM, LM_HEAD

_GLOBAL_NAMES = {EMBED: "TOKEN_EMBD", FINAL_NORM: "OUTPUT_NORM", LM_HEAD: "OUTPUT"}
# canonical layer suffix -> (gguf-py MODEL_TENSOR member, .weight / .bias)
_LAYER_NAMES = {
    "input_layernorm.weight": ("ATTN_NORM", "weight"), "self_attn.q_proj.weight": ("ATTN_Q", "weight"),
    "self_attn.k_proj.weight": ("ATTN_K", "weight"), "self_attn.v_proj.weight": ("ATTN_V", "weight"),
    "self_attn.o_proj.weight": ("ATTN_OUT", "weight"), "self_attn.q_proj.bias": ("ATTN_Q", "bias"),
    "self_attn.k_proj.bias": ("ATTN_K", "bias"), "self_attn.v_proj.bias": ("ATTN_V", "bias"),
    "self_attn.o_proj.bias": ("ATTN_OUT", "bias"),
    "self_attn.q_norm.weight": ("ATTN_Q_NORM", "weight"), "self_attn.k_norm.weight": ("ATTN_K_NORM", "weight"),
    "post_attention_layernorm.weight": ("FFN_NORM", "weight"),
    "mlp.gate_proj.weight": ("FFN_GATE", "weight"), "mlp.up_proj.weight": ("FFN_UP", "weight"),
    "mlp.down_proj.weight": ("FFN_DOWN", "weight"), "mlp.gate.weight": ("FFN_GATE_INP", "weight"),
    "mlp.experts.gate_proj": ("FFN_GATE_EXP", "weight"), "mlp.experts.up_proj": ("FFN_UP_EXP", "weight"),
    "mlp.experts.down_proj": ("FFN_DOWN_EXP", "weight")}
_MAX_DECODED_ARRAY = 64  # metadata arrays longer than this (token lists, merges) are not decoded


def gguf_name(name: str) -> str:
    """llama.cpp tensor name of a canonical (HF) name, e.g. ``blk.3.ffn_up.weight`` (gguf-py's
    ``TENSOR_NAMES``)."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES
    if name in _GLOBAL_NAMES:
        return TENSOR_NAMES[MODEL_TENSOR[_GLOBAL_NAMES[name]]] + ".weight"
    _, _, layer, suffix = name.split(".", 3)
    member, kind = _LAYER_NAMES[suffix]
    return TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=int(layer)) + "." + kind


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
        UnsupportedModelError: an architecture no family reads, or an unsupported MoE variant.
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
            tied="output.weight" not in self.tensors, qkv_bias="blk.0.attn_q.bias" in self.tensors)
        self._permuted = family_for_gguf(self.metadata.get("general.architecture")).gguf.permuted_qk

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
        if self._permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, self.config.num_heads)
        elif self._permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, self.config.num_kv_heads)
        return torch.from_numpy(np.array(w, copy=True))

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's ``rope_freqs.weight`` (Llama 3 style scaling stored as per-frequency divisors
        ``[head_dim // 2]``), or None when absent."""
        t = self.tensors.get("rope_freqs.weight")
        return None if t is None else torch.from_numpy(
            np.array(tensor_data(self._mm, t), dtype=np.float32))
