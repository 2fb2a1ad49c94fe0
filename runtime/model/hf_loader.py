"""Hugging Face checkpoints: a folder with ``config.json`` and ``*.safetensors`` (sharded or not).

Only the tensors a stage asks for are read (``safetensors.safe_open`` is lazy per tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.model.config import ModelConfig
from runtime.model.errors import ModelError, ModelNotFoundError
from runtime.model.tensor_names import EMBED, LM_HEAD


class HFCheckpoint:
    """An HF model folder.

    Raises (constructor):
        ModelNotFoundError: no ``config.json`` or no ``*.safetensors`` in the folder.
        UnsupportedModelError: architecture outside the Llama family.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise ModelNotFoundError(f"{self.path}: config.json is missing")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{self.path}: no *.safetensors weight files")
        self.config = ModelConfig.from_hf_config(json.loads(cfg_file.read_text()))
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    self._where[key] = f

    def read(self, name: str) -> torch.Tensor:
        """One tensor (canonical HF name) as fp32 on the CPU.

        A missing ``lm_head.weight`` falls back to the embedding when the config ties them.

        Raises:
            ModelError: the tensor is in no safetensors file (names the tensor and the folder).
        """
        if name == LM_HEAD and name not in self._where and self.config.tie_word_embeddings:
            name = EMBED
        f = self._where.get(name)
        if f is None:
            raise ModelError(f"{self.path}: tensor {name!r} is missing from the *.safetensors files")
        with safe_open(str(f), framework="pt") as handle:
            return handle.get_tensor(name).to(torch.float32)

    def rope_freq_factors(self) -> torch.Tensor | None:
        """HF folders express rope scaling in ``config.json`` only: always None."""
        return None
