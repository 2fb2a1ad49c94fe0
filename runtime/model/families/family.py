"""Model families declared as data: one YAML file per architecture in this folder.

A declaration names the architecture (HF ``architectures`` / ``model_type``, GGUF
``general.architecture``), the pieces its decoder layer is composed of (q/k/v and o biases, per-head
q/k RMSNorm, dense or mixture-of-experts MLP), its MoE fields (which config field holds the number
of experts, the experts per token, the expert width, whether top-k weights are renormalised), the
rope kinds it may use, the on-disk tensor names where they differ from the canonical ones, and the
config fields whose other values this runtime would mis-run (``require``). :func:`family_fields`
turns an HF ``config.json`` into the :class:`~runtime.model.config.ModelConfig` fields of the pieces,
refusing every unsupported value with an error naming the field and the supported values.

Adding a family: write ``<name>.yaml`` here (see ``docs/families.md``); no code change is needed
when its layer is made of existing pieces.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict

from runtime.model.errors import UnsupportedModelError

HERE = Path(__file__).resolve().parent


class FieldFlag(BaseModel):
    """A boolean piece read from a config field (``default`` when the field is absent)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    field: str
    default: bool = False


class MoESpec(BaseModel):
    """Where a family's config keeps its MoE shape (values are config field names; a list names
    alternatives, the first one present is read)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_experts: str | list[str]
    experts_per_token: str
    intermediate_size: str
    renormalize: bool | FieldFlag
    sparse_step: str | None = None
    dense_layers: str | None = None
    shared_experts: bool = False
    router_dtype: Literal["float32"] = "float32"
    gguf_renormalize_default: bool = True


class Pieces(BaseModel):
    """The pieces a family's decoder layer is composed of."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    qkv_bias: bool | FieldFlag = False
    o_bias: bool | FieldFlag = False
    qk_norm: bool = False
    mlp: Literal["dense", "moe"] = "dense"


class HFNames(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    architectures: list[str]
    model_types: list[str]


class GGUFNames(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    architectures: list[str] = []
    permuted_qk: bool = False


class Family(BaseModel):
    """One architecture's declaration (a YAML file of this folder)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    hf: HFNames
    gguf: GGUFNames = GGUFNames()
    pieces: Pieces = Pieces()
    moe: MoESpec | None = None
    rope_kinds: list[str]
    context_window_field: str | None = None
    hf_tensor_names: dict[str, str] = {}
    require: dict[str, list[Any]] = {}
    layer_types: list[str] | None = None

    def check_required(self, cfg: Mapping[str, Any]) -> None:
        """Refuse config values this runtime would mis-run.

        Raises:
            UnsupportedModelError: names the field, its value and the supported values.
        """
        for field, allowed in self.require.items():
            if cfg.get(field) not in allowed:
                raise UnsupportedModelError(
                    f"config field {field!r} = {cfg.get(field)!r} is not supported for the "
                    f"{self.name} family (supported values: {allowed})")
        if self.layer_types is not None and cfg.get("layer_types"):
            odd = sorted({t for t in cfg["layer_types"] if t not in self.layer_types})
            if odd:
                raise UnsupportedModelError(
                    f"config field 'layer_types' has {odd} layers (sliding-window attention is not "
                    f"supported; supported values: {self.layer_types})")


@functools.lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """Every declared family by name, read once from this folder's YAML files."""
    out = {}
    for f in sorted(HERE.glob("*.yaml")):
        fam = Family(**yaml.safe_load(f.read_text()))
        out[fam.name] = fam
    return out


def supported_hf_architectures() -> list[str]:
    return sorted(a for f in families().values() for a in f.hf.architectures)


def supported_gguf_architectures() -> list[str]:
    return sorted(a for f in families().values() for a in f.gguf.architectures)


def family_for_hf(cfg: Mapping[str, Any]) -> Family:
    """The family of an HF ``config.json`` (its first ``architectures`` entry, else ``model_type``).

    Raises:
        UnsupportedModelError: no family declares it (names ``architectures`` and the supported list).
    """
    archs = cfg.get("architectures") or []
    for fam in families().values():
        if archs and archs[0] in fam.hf.architectures:
            return fam
    for fam in families().values():
        if cfg.get("model_type") in fam.hf.model_types:
            return fam
    name = archs[0] if archs else cfg.get("model_type", "?")
    raise UnsupportedModelError(
        f"config field 'architectures': {name!r} is not supported "
        f"(supported: {supported_hf_architectures()})")


def family_for_gguf(arch: Any) -> Family:
    """The family whose GGUF ``general.architecture`` is ``arch``.

    Raises:
        UnsupportedModelError: no family reads it (names the supported list).
    """
    for fam in families().values():
        if arch in fam.gguf.architectures:
            return fam
    raise UnsupportedModelError(
        f"GGUF architecture {arch!r} is not supported (supported: {supported_gguf_architectures()})")


def _flag(value: bool | FieldFlag, cfg: Mapping[str, Any]) -> bool:
    if isinstance(value, FieldFlag):
        v = cfg.get(value.field)
        return value.default if v is None else bool(v)
    return bool(value)


def family_fields(fam: Family, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The piece fields of :class:`~runtime.model.config.ModelConfig` for an HF config of ``fam``.

    Raises:
        UnsupportedModelError: a field of ``require`` / ``layer_types`` outside the supported values.
    """
    fam.check_required(cfg)
    out: dict[str, Any] = {"family": fam.name, "qkv_bias": _flag(fam.pieces.qkv_bias, cfg),
                           "o_bias": _flag(fam.pieces.o_bias, cfg), "qk_norm": fam.pieces.qk_norm}
    if fam.pieces.mlp == "moe" and fam.moe is not None:
        m = fam.moe
        names = [m.num_experts] if isinstance(m.num_experts, str) else m.num_experts
        experts = next((cfg[n] for n in names if cfg.get(n) is not None), None)
        if experts is None:
            raise UnsupportedModelError(f"config field {names[0]!r} (number of experts) is missing")
        out.update(num_experts=int(experts), experts_per_token=int(cfg[m.experts_per_token]),
                   moe_intermediate_size=int(cfg[m.intermediate_size]),
                   moe_renormalize=_flag(m.renormalize, cfg),
                   moe_sparse_step=int(cfg.get(m.sparse_step) or 1) if m.sparse_step else 1,
                   moe_dense_layers=tuple(cfg.get(m.dense_layers) or ()) if m.dense_layers else ())
    return out


def family_of(name: str) -> Family:
    """The family called ``name`` (a ``ModelConfig.family`` value)."""
    return families()[name]
