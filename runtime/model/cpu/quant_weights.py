"""Read one stage's weights for the CPU fast path, keeping linear weights quantized.

GGUF ``Q4_1`` / ``Q8_0`` tensors are read block by block (:mod:`runtime.model.cpu.gguf_blocks`),
never as a whole fp32 matrix; other tensors (F32 / F16 GGUF, Hugging Face folders) are read in
fp32 and quantized here. Layer weights end in ``bits`` (default 8: the GGUF 4-bit values kept to
1/510 of each block's range; 4: half the memory, one GGUF step of error). A ``Q8_0`` tensor at 8
bits (the embedding and tied LM head of the default model) is used exactly as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.model.cpu.gguf_blocks import BlockWeight, Q8_0, concat_rows, from_gguf, quantize, \
    requantize, supported
from runtime.model.gguf_loader import GGUFCheckpoint, gguf_name, unpermute_qk
from runtime.model.tensor_names import EMBED, FINAL_NORM, LM_HEAD, layer_name
from runtime.model.weights import Checkpoint

ATTN, MLP = ("q", "k", "v"), ("gate", "up")


@dataclass
class QuantLayer:
    """One decoder layer: fp32 norms ``[H]`` and the fused quantized GEMMs (``qkv [(NH + 2 KVH) D,
    H]``, ``o [H, NH D]``, ``gate_up [2 I, H]``, ``down [H, I]``)."""
    ln1: np.ndarray
    ln2: np.ndarray
    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight


def read_linear(ckpt: Checkpoint, name: str, bits: int) -> BlockWeight:
    """One linear weight ``[out, in]`` (canonical name) in ``bits``-bit blocks; Q / K rows
    un-permuted for GGUF as the reference loader does."""
    cfg = ckpt.config
    t = ckpt.tensors.get(gguf_name(name)) if isinstance(ckpt, GGUFCheckpoint) else None
    if t is None or not supported(t.ggml_type):
        return quantize(ckpt.read(name).numpy(), bits)
    from runtime.model.gguf_file import tensor_data
    n, k = int(t.dims[1]), int(t.dims[0])
    w = from_gguf(tensor_data(ckpt._mm, t), t.ggml_type, n, k)
    heads = (cfg.num_heads if name.endswith("q_proj.weight") else
             cfg.num_kv_heads if name.endswith("k_proj.weight") else None)
    if heads is not None:
        w = w.take_rows(unpermute_qk(np.arange(n)[:, None], heads)[:, 0])
    return w if (t.ggml_type == Q8_0 and bits == 8) else requantize(w, bits)


def read_layer(ckpt: Checkpoint, i: int, bits: int) -> QuantLayer:
    """Layer ``i``'s tensors (see :class:`QuantLayer`)."""
    lin = lambda s: read_linear(ckpt, layer_name(i, s), bits)  # noqa: E731
    norm = lambda s: ckpt.read(layer_name(i, s)).numpy().astype(np.float32)  # noqa: E731
    return QuantLayer(norm("input_layernorm.weight"), norm("post_attention_layernorm.weight"),
                      concat_rows([lin(f"self_attn.{p}_proj.weight") for p in ATTN]),
                      lin("self_attn.o_proj.weight"),
                      concat_rows([lin(f"mlp.{p}_proj.weight") for p in MLP]),
                      lin("mlp.down_proj.weight"))


class QuantEmbedding:
    """Token embedding rows ``[V, H]`` kept in 8-bit blocks; :meth:`__call__` dequantizes only the
    rows of the step's tokens.

    Args:
        w: the embedding as 8-bit :class:`BlockWeight` (GGUF Q8_0 as stored, or quantized).
    """

    def __init__(self, w: BlockWeight) -> None:
        nb = w.k // 32
        self.k = w.k
        self.q = torch.from_numpy(w.packed.reshape(w.n, nb, 32))                 # [V, nb, 32] u8
        self.scales = torch.from_numpy(w.scales.reshape(w.n, nb, 1))              # [V, nb, 1]
        self.zp = (None if w.zero_points is None                                 # [V, nb, 1]
                   else torch.from_numpy(w.zero_points.astype(np.float32).reshape(w.n, nb, 1)))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` long -> ``[T, H]`` fp32."""
        q = self.q.index_select(0, ids).float()
        zp = 128.0 if self.zp is None else self.zp.index_select(0, ids)
        return ((q - zp) * self.scales.index_select(0, ids)).reshape(-1, self.k)


def read_head(ckpt: Checkpoint) -> tuple[np.ndarray, BlockWeight]:
    """Final norm ``[H]`` and the LM head ``[V, H]`` (the embedding when tied) in 8 bits (a GGUF
    Q8_0 head exactly as stored)."""
    cfg = ckpt.config
    name = EMBED if cfg.tie_word_embeddings else LM_HEAD
    if isinstance(ckpt, GGUFCheckpoint) and gguf_name(LM_HEAD) not in ckpt.tensors:
        name = EMBED
    return ckpt.read(FINAL_NORM).numpy().astype(np.float32), read_linear(ckpt, name, 8)


def read_embedding(ckpt: Checkpoint) -> QuantEmbedding:
    """The token embedding in 8-bit blocks."""
    return QuantEmbedding(read_linear(ckpt, EMBED, 8))
