"""Checkpoint access shared by the GGUF and HF loaders: canonical tensor names (HF Llama names),
the tensors one pipeline stage needs, their expected shapes, and :func:`open_checkpoint`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Protocol

import torch
from tqdm.auto import tqdm

from runtime.model.config import ModelConfig
from runtime.model.errors import WeightShapeError

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_SUFFIXES = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


class Checkpoint(Protocol):
    """A model on disk: its config and a way to read named tensors (canonical HF names)."""
    path: Path
    config: ModelConfig

    def read(self, name: str) -> torch.Tensor:
        """One tensor as fp32 on the CPU (GGUF: dequantized, Q/K rows un-permuted)."""


def layer_name(layer: int, suffix: str) -> str:
    """Canonical name of one decoder-layer tensor, e.g. ``model.layers.3.mlp.up_proj.weight``."""
    return f"model.layers.{layer}.{suffix}"


def stage_tensor_names(cfg: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """Canonical names a stage owning layers ``[start, end)`` loads (embeddings on the first stage,
    final norm + LM head on the last; a tied LM head reads the embedding tensor)."""
    start, end = layer_range
    names = [EMBED] if start == 0 else []
    names += [layer_name(i, s) for i in range(start, end) for s in LAYER_SUFFIXES]
    if end == cfg.num_layers:
        names.append(FINAL_NORM)
        if cfg.tie_word_embeddings and start != 0:
            names.append(EMBED)
        elif not cfg.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape ``name`` must have under ``cfg`` ([out_features, in_features] for linear weights)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    if name in (EMBED, LM_HEAD):
        return (cfg.vocab_size, h)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    return {
        FINAL_NORM: (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }[suffix]


def load_tensors(ckpt: Checkpoint, names: Iterable[str], *, dtype: torch.dtype,
                 device: str | torch.device, progress: bool = True) -> dict[str, torch.Tensor]:
    """Read, shape-check and cast ``names`` from ``ckpt``.

    Raises:
        WeightShapeError: a tensor's shape differs from :func:`expected_shape` (names the tensor).
    """
    names = list(names)
    out: dict[str, torch.Tensor] = {}
    for name in tqdm(names, desc=f"loading {ckpt.path.name}", unit="tensor", disable=not progress,
                     leave=False):
        t = ckpt.read(name)
        want = expected_shape(ckpt.config, name)
        if tuple(t.shape) != want:
            raise WeightShapeError(
                f"{ckpt.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
        out[name] = t.to(device=device, dtype=dtype)
    return out


def open_checkpoint(path: Path) -> Checkpoint:
    """Open a resolved model path (see ``registry.resolve_model_path``) without reading weights.

    GGUF files are opened once per process per (file, size, mtime): parsing the header (vocabulary
    and merges included) takes seconds, and ``load_model_config`` + ``load_stage`` both need it.
    """
    from runtime.model.registry import is_gguf
    if is_gguf(path):
        st = path.stat()
        return _open_gguf(str(path.resolve()), st.st_size, st.st_mtime_ns)
    from runtime.model.hf_loader import HFCheckpoint
    return HFCheckpoint(path)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> Checkpoint:
    """Cached GGUF open (memory-mapped; the key includes size and mtime so a rewritten file reopens)."""
    from runtime.model.gguf_loader import GGUFCheckpoint
    return GGUFCheckpoint(Path(path))
