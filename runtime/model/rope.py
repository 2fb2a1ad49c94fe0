"""Rotary position embedding (RoPE, Su et al. 2021) frequencies and tables for every rope kind the
families use: ``default``, ``linear``, ``llama3`` and ``yarn``.

Frequencies follow transformers' ``modeling_rope_utils`` (the same formulas and fp32 roundings):

* ``default``: ``inv_freq_i = theta ** (-2i / d)``.
* ``linear``: every frequency divided by ``factor``.
* ``llama3``: Meta's Llama 3.1 rule (low frequencies divided by ``factor``, high ones kept, a smooth
  blend between).
* ``yarn`` (Peng et al. 2023): a per-frequency ramp between interpolated (``/ factor``) and original
  frequencies over the correction range of ``beta_fast`` / ``beta_slow`` rotations within
  ``original_max_position_embeddings``, and cos / sin scaled by the attention factor
  ``0.1 * ln(factor) + 1`` (or the configured ``attention_factor`` / ``mscale`` ratio).

llama.cpp's per-frequency divisors (``rope_freqs.weight``) are applied after scaling when given.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

#: rope scaling kinds this runtime computes (anything else is refused at load)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The rope scaling kind of an HF-style ``rope_scaling`` dict (``default`` when None)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_inv_freq(cfg, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 (radians per position) of a ``ModelConfig``.

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
    elif kind == "yarn":
        inv = _yarn(cfg, sc)
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    return inv


def rope_attention_factor(cfg) -> float:
    """Scale applied to cos and sin (1.0 except for ``yarn``)."""
    sc = cfg.rope_scaling or {}
    if rope_type(sc) != "yarn":
        return 1.0
    factor = float(sc["factor"])
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all))
    return _mscale(factor)


def rope_tables(inv_freq: torch.Tensor, max_len: int, attention_factor: float = 1.0,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, head_dim // 2]`` fp32 for positions ``0..max_len-1``, each
    multiplied by ``attention_factor`` (yarn)."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def model_rope_tables(cfg, max_len: int, freq_factors: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` of a ``ModelConfig`` (frequencies and attention factor of its kind)."""
    return rope_tables(rope_inv_freq(cfg, freq_factors), max_len, rope_attention_factor(cfg))


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1 frequency rescaling (same formula as transformers ``_compute_llama3_parameters``)."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg, sc: Mapping[str, Any]) -> torch.Tensor:
    """YaRN inverse frequencies (transformers ``_compute_yarn_parameters``)."""
    d, base, factor = cfg.head_dim, cfg.rope_theta, float(sc["factor"])
    old_len = sc.get("original_max_position_embeddings") or cfg.max_position_embeddings
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
