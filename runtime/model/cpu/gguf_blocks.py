"""GGUF quantized blocks -> the operands of ONNX Runtime's ``MatMulNBits`` (no requantization).

GGUF stores a weight ``[N, K]`` row by row in blocks of 32 values along K (ggml's ``block_q4_1`` /
``block_q8_0``):

* ``Q4_1`` (20 bytes): fp16 scale ``d``, fp16 min ``m``, 16 bytes of nibbles; value
  ``j < 16`` is the low nibble of byte ``j``, value ``j >= 16`` the high nibble of byte ``j - 16``;
  ``w = d * q + m``.
* ``Q8_0`` (34 bytes): fp16 scale ``d``, 32 signed bytes; ``w = d * q``.

``MatMulNBits`` (com.microsoft) wants ``B [N, K / 32, blob]`` uint8, ``scales [N * K / 32]`` and a
zero point per block, with ``w = (q - zp) * scale``; 4-bit values are packed two per byte, element
``2i`` in the low nibble of byte ``i``. So Q4_1 maps exactly with a float zero point
``zp = -m / d`` (blocks with ``d == 0`` hold the constant ``m``: they get ``scale = m, q = 1,
zp = 0``), and Q8_0 maps exactly with ``q + 128`` and the default zero point 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Q4_1, Q8_0 = 3, 8       # ggml type ids
BLOCK = 32              # values per block along K (both types)
_BYTES = {Q4_1: 20, Q8_0: 34}


@dataclass
class BlockWeight:
    """One weight in ``MatMulNBits`` form.

    Attributes:
        n, k: output / input features (``w [n, k]``).
        bits: 4 or 8.
        packed: ``[n, k / 32, 16 or 32]`` uint8 quantized values.
        scales: ``[n * k / 32]`` fp32 per-block scales.
        zero_points: ``[n * k / 32]`` fp32 per-block zero points, or None (8-bit: 128).
    """
    n: int
    k: int
    bits: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """The fp32 weight ``[n, k]`` these operands encode (tests; the reference loader reads
        the same values through ``gguf.quants.dequantize``)."""
        nb = self.k // BLOCK
        if self.bits == 4:
            lo, hi = self.packed & 0x0F, self.packed >> 4
            q = np.stack([lo, hi], -1).reshape(self.n, nb, BLOCK).astype(np.float32)
        else:
            q = self.packed.astype(np.float32)
        zp = self._zero_points(nb)
        return ((q - zp) * self.scales.reshape(self.n, nb, 1)).reshape(self.n, self.k)

    def _zero_points(self, nb: int):
        """Zero points broadcastable to ``[n, nb, 32]`` (default 128 / 8 when absent)."""
        if self.zero_points is None:
            return float(1 << (self.bits - 1))
        zp = self.zero_points
        if zp.dtype == np.uint8 and self.bits == 4:   # two per byte, rows padded to whole bytes
            zp = zp.reshape(self.n, -1)
            zp = np.stack([zp & 0x0F, zp >> 4], -1).reshape(self.n, -1)[:, :nb]
        return zp.reshape(self.n, nb, 1).astype(np.float32)

    def take_rows(self, order: np.ndarray) -> "BlockWeight":
        """The weight with its output rows reordered (``w[order]``; blocks run along K, so rows
        move whole)."""
        nb = self.k // BLOCK
        zp = None if self.zero_points is None else \
            self.zero_points.reshape(self.n, -1)[order].reshape(-1)
        return BlockWeight(len(order), self.k, self.bits, self.packed[order],
                           self.scales.reshape(self.n, nb)[order].reshape(-1), zp)


def supported(ggml_type: int) -> bool:
    """Whether :func:`from_gguf` takes tensors of this ggml type."""
    return ggml_type in _BYTES


def from_gguf(raw: np.ndarray, ggml_type: int, n: int, k: int) -> BlockWeight:
    """Convert a GGUF tensor's bytes to :class:`BlockWeight`.

    Args:
        raw: the tensor's bytes (uint8, ``n * k / 32`` blocks, row-major).
        ggml_type: ``Q4_1`` (3) or ``Q8_0`` (8).
    Raises:
        ValueError: another type, or ``k`` not a multiple of 32.
    """
    if ggml_type not in _BYTES:
        raise ValueError(f"ggml type {ggml_type} has no MatMulNBits form (Q4_1 and Q8_0 do)")
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of the {BLOCK}-value block")
    nb = k // BLOCK
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, _BYTES[ggml_type])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)   # [n, nb]
    if ggml_type == Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return BlockWeight(n, k, 8, q.astype(np.uint8), d.reshape(-1), None)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[..., 4:]                                                     # [n, nb, 16]
    q = np.concatenate([nib & 0x0F, nib >> 4], -1)                            # [n, nb, 32]
    flat = d == 0
    if flat.any():   # constant block: w = m = (1 - 0) * m
        q[flat] = 1
    scale = np.where(flat, m, d)
    zp = np.where(flat, 0.0, -m / np.where(flat, 1.0, d)).astype(np.float32)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)             # [n, nb, 16]
    return BlockWeight(n, k, 4, packed, scale.reshape(-1).astype(np.float32), zp.reshape(-1))


def requantize(w: BlockWeight, bits: int) -> BlockWeight:
    """Re-quantize ``w`` to ``bits`` with integer zero points (see :func:`quantize`); 8 bits keep
    every GGUF 4-bit value within ``scale / 2`` (1/510 of its block's range)."""
    return quantize(w.dequantize(), bits)


def quantize(x: np.ndarray, bits: int) -> BlockWeight:
    """Quantize an fp32 weight ``x [n, k]`` asymmetrically per 32-value block to ``bits`` (4 or 8)
    with uint8 zero points, the form MLAS has fast kernels for: ``scale = (max - min) /
    (2^bits - 1)`` (the range always holds 0), ``zp = round(-min / scale)``,
    ``q = clip(round(x / scale) + zp)``; error at most ``scale / 2`` per value.

    Returns:
        a :class:`BlockWeight` whose ``zero_points`` are uint8, packed two per byte per row for
        4 bits (``[n * ceil(k / 64)]``), one per block for 8 bits (``[n * k / 32]``).
    Raises:
        ValueError: ``k`` not a multiple of 32, or ``bits`` not 4 / 8.
    """
    n, k = x.shape
    if k % BLOCK or bits not in (4, 8):
        raise ValueError(f"cannot quantize [{n}, {k}] to {bits} bits in {BLOCK}-value blocks")
    nb, qmax = k // BLOCK, (1 << bits) - 1
    x = np.asarray(x, dtype=np.float32).reshape(n, nb, BLOCK)
    lo = np.minimum(x.min(-1), 0.0)
    hi = np.maximum(x.max(-1), 0.0)
    scale = (hi - lo) / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, qmax)
    q = np.clip(np.round(x / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    zp = zp.astype(np.uint8)
    if bits == 8:
        return BlockWeight(n, k, 8, q, scale.reshape(-1), zp.reshape(-1))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    if nb % 2:
        zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], 1)
    zpp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
    return BlockWeight(n, k, 4, packed, scale.reshape(-1), zpp.reshape(-1))


def concat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Stack weights of the same K, bits and zero-point form along N (fused QKV / gate-up)."""
    a = parts[0]
    zp = None if a.zero_points is None else np.concatenate(
        [p.zero_points.reshape(p.n, -1) for p in parts]).reshape(-1)
    return BlockWeight(sum(p.n for p in parts), a.k, a.bits,
                       np.concatenate([p.packed for p in parts]),
                       np.concatenate([p.scales for p in parts]), zp)
