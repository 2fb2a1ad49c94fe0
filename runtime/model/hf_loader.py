"""Hugging Face checkpoints: a folder with ``config.json`` and ``*.safetensors`` (sharded or not).

Only the tensors a stage asks for are read: the shard of each tensor comes from
``model.safetensors.index.json`` when present (else from the headers of the ``*.safetensors``
files), and ``safetensors.safe_open`` reads one tensor at a time from a memory map, so a rank's peak
host memory is its own tensors plus one tensor in flight. Canonical names (``tensor_names``) map to
the family's on-disk names (``hf_tensor_names`` of its declaration, e.g. Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``); stacked expert tensors are built from the per-expert
ones (or read as the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` of newer checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.model.config import ModelConfig
from runtime.model.errors import ModelError, ModelNotFoundError
from runtime.model.tensor_names import EMBED, EXPERT_SUFFIXES, LM_HEAD, layer_name, split_layer_name

INDEX_FILE = "model.safetensors.index.json"
_PER_EXPERT = {"mlp.experts.gate_proj": "mlp.experts.{e}.gate_proj.weight",
               "mlp.experts.up_proj": "mlp.experts.{e}.up_proj.weight",
               "mlp.experts.down_proj": "mlp.experts.{e}.down_proj.weight"}


class HFCheckpoint:
    """An HF model folder.

    Raises (constructor):
        ModelNotFoundError: no ``config.json`` or no ``*.safetensors`` in the folder.
        UnsupportedModelError: an architecture or config field no family supports.
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
        self._names = dict(self.config.family_spec.hf_tensor_names)
        self._where: dict[str, Path] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self._where = {k: self.path / v for k, v in weight_map.items()}
        else:
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    for key in handle.keys():
                        self._where[key] = f

    def read(self, name: str) -> torch.Tensor:
        """One tensor (canonical name) as fp32 on the CPU; stacked experts ``[E, out, in]``.

        A missing ``lm_head.weight`` falls back to the embedding when the config ties them.

        Raises:
            ModelError: the tensor is in no safetensors file (names the tensor and the folder).
        """
        disk = self._disk_name(name)
        if disk is None:
            return self._read_experts(*split_layer_name(name))
        return self._read_disk(disk)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``read(name)[..., start:stop, ...]`` (along ``dim``), reading only that slice from the
        memory map (stacked experts: read whole, then narrowed). For tensor-parallel shards.

        Raises:
            ModelError: as :meth:`read`.
        """
        disk = self._disk_name(name)
        if disk is None:
            return self.read(name).narrow(dim, start, stop - start).contiguous()
        f = self._where.get(disk)
        if f is None:
            raise ModelError(f"{self.path}: tensor {disk!r} is missing from the *.safetensors files")
        with safe_open(str(f), framework="pt") as handle:
            index = (slice(None),) * dim + (slice(start, stop),)
            return handle.get_slice(disk)[index].to(torch.float32).contiguous()

    def _disk_name(self, name: str) -> str | None:
        """The on-disk name of canonical ``name`` (tied LM head -> embedding, family renames);
        None for stacked experts (several tensors on disk)."""
        if name == LM_HEAD and name not in self._where and self.config.tie_word_embeddings:
            name = EMBED
        parts = split_layer_name(name)
        if parts is not None and parts[1] in EXPERT_SUFFIXES:
            return None
        if parts is not None and parts[1] in self._names:
            return layer_name(parts[0], self._names[parts[1]])
        return name

    def _read_experts(self, layer: int, suffix: str) -> torch.Tensor:
        """The experts of one projection stacked ``[E, out, in]`` (per-expert or fused on disk)."""
        pattern = self._names.get(suffix, _PER_EXPERT[suffix])
        first = layer_name(layer, pattern.format(e=0))
        if first in self._where:
            return torch.stack([self._read_disk(layer_name(layer, pattern.format(e=e)))
                                for e in range(self.config.num_experts)])
        if suffix == "mlp.experts.down_proj":
            return self._read_disk(layer_name(layer, "mlp.experts.down_proj"))
        fused = self._read_disk(layer_name(layer, "mlp.experts.gate_up_proj"))  # [E, 2 I, H]
        half = fused.shape[1] // 2
        return (fused[:, :half] if suffix == "mlp.experts.gate_proj" else fused[:, half:]).contiguous()

    def _read_disk(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ModelError(f"{self.path}: tensor {name!r} is missing from the *.safetensors files")
        with safe_open(str(f), framework="pt") as handle:
            return handle.get_tensor(name).to(torch.float32)

    def rope_freq_factors(self) -> torch.Tensor | None:
        """HF folders express rope scaling in ``config.json`` only: always None."""
        return None
