"""Rotary position embedding (RoPE), half-split form (GPT-NeoX / HF Llama ``rotate_half``).

Frequencies follow Su et al. 2021 (``inv_freq_i = theta ** (-2i / d)``) with the scalings of
transformers' ``modeling_rope_utils``: ``linear`` (divide every frequency by ``factor``) and
``llama3`` (Meta's Llama 3.1 rule: low frequencies divided by ``factor``, high ones kept, a smooth
blend between). llama.cpp's per-frequency divisors (``rope_freqs.weight``) are accepted too.
"""

from __future__ import annotations

import math

import torch

from runtime.model.config import ModelConfig, rope_type


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 (radians per position) for ``cfg``.

    Args:
        freq_factors: optional llama.cpp divisors ``[head_dim // 2]`` applied after scaling.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind, sc = rope_type(cfg.rope_scaling), cfg.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, float(sc["factor"]), float(sc["low_freq_factor"]),
                      float(sc["high_freq_factor"]), float(sc["original_max_position_embeddings"]))
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    return inv


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1 frequency rescaling (same formula as transformers ``_compute_llama3_parameters``)."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, head_dim // 2]`` fp32 for positions ``0..max_len-1``."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by per-token angles; ``cos``/``sin`` are ``[T, head_dim // 2]``
    already in ``x``'s dtype. Half-split pairing: dim i rotates with dim i + head_dim // 2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
