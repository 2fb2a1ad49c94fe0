"""A fast GGUF header reader: key/value metadata and the tensor index, no tensor data.

``gguf.GGUFReader`` indexes every field element with numpy views, which takes ~5 s for SmolLM2's
header (the vocabulary and merges are ~100k strings); this parser reads the same header in ~0.2 s
with ``struct``. Tensor data is then taken from a read-only ``numpy.memmap`` of the file, shaped as
``GGUFReader`` shapes it (reversed GGUF dims; quantized types as their raw bytes per row) so
``gguf.quants.dequantize`` can decode it. Format: GGUF v2/v3, little-endian
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the index: GGUF ``dims`` (fastest first), ggml type id, absolute byte offset."""
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (key -> value) and tensor index (name -> :class:`TensorInfo`) of one file."""
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the header of a GGUF file.

    Returns:
        Metadata values as Python scalars / str / list[str] / 1-D numpy arrays, and the tensor
        index with absolute data offsets (alignment from ``general.alignment``, default 32 bytes).
    Raises:
        ValueError: not a GGUF file, unsupported version, unknown value type, duplicate tensor.
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        meta = {_read_str(f): _read_value(f, struct.unpack("<I", f.read(4))[0], path)
                for _ in range(n_kv)}
        index = [_read_tensor_info(f) for _ in range(n_tensors)]
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-f.tell() // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, rel in index:
        if name in tensors:
            raise ValueError(f"{path}: duplicate tensor {name!r}")
        tensors[name] = TensorInfo(name, dims, ggml_type, start + rel)
    return GGUFHeader(Path(path), meta, tensors)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the key/value metadata of a GGUF file (see :func:`read_gguf_header`)."""
    return read_gguf_header(path).metadata


def tensor_data(mm: np.memmap, info: TensorInfo) -> np.ndarray:
    """The tensor's data as ``gguf.GGUFReader`` shapes it: float types as ``reversed(dims)``,
    quantized types as raw ``uint8`` rows (``quant_shape_to_byte_shape``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    qtype = GGMLQuantizationType(info.ggml_type)
    shape = tuple(reversed(info.dims))
    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    n = int(np.prod(info.dims))
    if qtype in plain:
        dtype = np.dtype(plain[qtype])
        return np.frombuffer(mm, dtype=dtype, count=n, offset=info.offset).reshape(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.frombuffer(mm, dtype=np.uint8, count=n * type_size // block, offset=info.offset)
    return raw.reshape(quant_shape_to_byte_shape(shape, qtype))


def _read_tensor_info(f: BinaryIO) -> tuple[str, tuple[int, ...], int, int]:
    name = _read_str(f)
    (n_dims,) = struct.unpack("<I", f.read(4))
    dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
    ggml_type, offset = struct.unpack("<IQ", f.read(12))
    return name, tuple(int(d) for d in dims), ggml_type, offset


def _read_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int, path: str | Path) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype][0]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        sub, n = struct.unpack("<IQ", f.read(12))
        if sub in _SCALARS:
            dtype = np.dtype(_SCALARS[sub][1]).newbyteorder("<")
            return np.frombuffer(f.read(n * dtype.itemsize), dtype=dtype).copy()
        return [_read_value(f, sub, path) for _ in range(n)]
    raise ValueError(f"{path}: unknown GGUF metadata value type {vtype}")
