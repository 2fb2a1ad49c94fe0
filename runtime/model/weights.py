"""Checkpoint access shared by the GGUF and HF loaders: the :class:`Checkpoint` protocol,
:func:`load_tensors` and :func:`open_checkpoint` (tensor names: :mod:`runtime.model.tensor_names`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Protocol

import torch
from tqdm.auto import tqdm

from runtime.model.config import ModelConfig
from runtime.model.errors import WeightShapeError
from runtime.model.tensor_names import expected_shape


class Checkpoint(Protocol):
    """A model on disk: its config and a way to read named tensors (canonical HF names)."""
    path: Path
    config: ModelConfig

    def read(self, name: str) -> torch.Tensor:
        """One tensor as fp32 on the CPU (GGUF: dequantized, Q/K rows un-permuted)."""


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
