"""Engine configuration (pydantic): the scheduler's :class:`~ppstate.budget.SchedulerConfig`, contained,
plus what only the runtime needs. The CLI flags of ``runtime.serve`` / ``runtime.generate`` /
``runtime.bench`` are generated from these fields (:mod:`runtime.cli_common`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ppstate.budget import SchedulerConfig
from ppstate.speculative import MAX_SPEC_TOKENS

#: the scheduler fields; ``EngineConfig(max_num_seqs=8)`` is short for ``scheduler={...: 8}``
SCHEDULER_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerConfig))
#: the engine's defaults where they differ from the scheduler's own (a server-sized budget)
ENGINE_SCHEDULER_DEFAULTS = {"max_num_seqs": 32, "max_num_batched_tokens": 512,
                             "max_prefill_chunk": 128, "spec_probe_ngram": 3}
#: the engine's bounds on scheduler fields (inclusive; None: unbounded): the scheduler itself
#: only needs them >= 1, the engine caps what one machine can hold
SCHEDULER_BOUNDS = {"pp_size": (1, 64), "max_num_seqs": (1, 4096), "max_model_len": (16, None),
                    "max_num_batched_tokens": (1, None), "max_prefill_chunk": (1, None),
                    "block_size": (1, 1024), "num_spec_tokens": (0, MAX_SPEC_TOKENS),
                    "spec_probe_ngram": (0, None)}


def default_scheduler() -> SchedulerConfig:
    """The scheduler part of ``EngineConfig()``."""
    return SchedulerConfig(**ENGINE_SCHEDULER_DEFAULTS)


class EngineConfig(BaseModel):
    """Everything needed to start a pipeline.

    The scheduler fields (``pp_size``, ``max_num_seqs``, ``max_model_len``,
    ``max_num_batched_tokens``, ``max_prefill_chunk``, ``mode``, ``block_size``,
    ``enable_prefix_caching``) live in :attr:`scheduler`, declared once in
    :class:`~ppstate.budget.SchedulerConfig`; they may be given flat
    (``EngineConfig(pp_size=2, max_model_len=64)``) or as ``scheduler={...}``, and unset ones take
    :data:`ENGINE_SCHEDULER_DEFAULTS`, then the scheduler's defaults. ``scheduler.num_kv_blocks``
    is replaced at start by the smallest KV block count the ranks report (``kv_cache_memory``).
    Every other field's meaning is its ``description`` (also the help of its CLI flag).

    Raises:
        pydantic.ValidationError: a bad field; ``loc`` (or, for a scheduler bound, ``ctx.field``)
            names it.
    """
    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="default", description="'default' (embedded SmolLM2-135M-Instruct "
                       "GGUF), a .gguf file or a Hugging Face folder")
    scheduler: SchedulerConfig = Field(default_factory=default_scheduler,
                                       description="the scheduler's budgets and PP schedule")
    pp_layer_partition: str | None = Field(default=None, description="layers per stage, e.g. "
                                           "19,11 (default: balanced by estimated cost)")
    chat_template: str | None = Field(default=None, description="replace the model's chat "
                                      "template: a Jinja file, or 'hermes' (built-in ChatML that "
                                      "renders tools and tool calls, docs/structured.md)")
    validate_mirrors: str = Field(default="every", description="compare the CPU mirrors with "
                                  "device state every step, every N steps, or off")
    mirror_check_kernel: Literal["graph", "fused"] = Field(
        default="graph", description="CUDA ranks: how the after-step mirror check sets its flag "
        "inside its CUDA graph; graph = about twenty torch kernels, fused = one Triton kernel "
        "(same flag; on the H200 about 17 us less device time per step, the same host time, "
        "docs/mirror_audit.md)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda "
                                                   "when torch sees a CUDA device, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: float32 on the CPU, bfloat16 on CUDA")
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per rank (CPU)")
    cpu_path: Literal["exact", "fast"] = Field(
        default="exact", description="CPU ranks: exact = the fp32, batch-invariant reference "
        "(token-for-token equal to transformers; tests); fast = weights kept quantized, ONNX "
        "Runtime int8 GEMMs (docs/cpu_fast_path.md; runtime.serve's default)")
    cuda_path: Literal["fast", "reference"] = Field(
        default="fast", description="CUDA ranks: fast = paged Triton kernels and decode CUDA "
        "graphs (docs/gpu.md; piecewise graphs under TP over gloo, docs/tp.md); reference = the "
        "exact StageModel path (comparisons)")
    cpu_threads: int | None = Field(default=None, ge=1, description="fast CPU path: threads the "
                                    "ranks of the pipeline share, split evenly between stages "
                                    "(default: every rank may use every core; its threads sleep "
                                    "while it waits)")
    cpu_pin: bool = Field(default=False, description="fast CPU path: pin each rank to its own "
                          "share of the cores (spawn launcher, one pipeline; on a machine shared "
                          "with other jobs pinning measured 1.3-3x slower)")
    step_timeout_s: float = Field(default=120.0, gt=0, description="seconds any receive, "
                                  "collective or step may take (then the engine fails)")
    heartbeat_timeout_s: float = Field(default=6.0, gt=1.0, description="seconds a rank may be "
                                       "silent (killed, frozen; ranks beat once a second) before "
                                       "the engine fails")
    trace_dir: str | None = Field(default=None, description="record the run in a new run-* "
                                  "directory here (header + one JSONL event file per process; "
                                  "replay with python -m ppstate.replay DIR)")
    trace_prompts: bool = Field(default=False, description="with a trace directory: also record "
                                "prompt token ids (default: prompt lengths only)")
    served_model_name: str | None = Field(default=None, description="name reported by "
                                          "/v1/models (default: derived from the model file)")
    launcher: Literal["spawn", "torchrun"] = Field(
        default="spawn", description="spawn: one process per rank on this machine; torchrun: the "
        "ranks are torchrun's processes, possibly on several machines (docs/torchrun.md)")
    engine_port: int = Field(default=29600, ge=1, le=65535 - 65, description="torchrun: the "
                             "engine's TCP ports on the rank-0 host are PORT (results) and "
                             "PORT + 1 + rank (steps)")
    kv_cache_memory: str | None = Field(
        default=None, description="KV cache per rank: bytes with an optional KB/MB/GB suffix "
        "(powers of 1024, e.g. 24MB), or a fraction in (0, 1] of the device memory free after "
        "loading the weights (CUDA, e.g. 0.9); default: max_model_len tokens in every slot")
    enforce_eager: bool = Field(default=False, description="CUDA: run decode steps eagerly "
                                "instead of replaying captured CUDA graphs")
    stall_timeout_s: float = Field(default=8.0, ge=0, description="seconds a rank may stay in "
                                   "one compute phase of a step (forward, sample, ...), or every "
                                   "rank wait on communication, before the engine fails (0: off; "
                                   "a rank's first step gets 3x; runtime/engine/stall.py)")
    dp_size: int = Field(default=1, ge=1, le=64, description="data-parallel replicas: "
                         "independent pipelines of pp_size ranks each behind one server "
                         "(least-loaded routing; runtime/dp/replicas.py); dp x pp rank processes")
    tp_size: int = Field(default=1, ge=1, le=64, description="tensor-parallel ranks inside each "
                         "pipeline stage: pp x tp rank processes per pipeline (docs/tp.md)")
    spec_ngram: int = Field(default=3, ge=1, le=16, description="n-gram length the speculative "
                            "proposer matches against the request's earlier tokens (tokens)")
    step_cost: str | None = Field(default=None, description="JSON file of step-cost coefficients "
                                  "(python -m runtime.bench contention --json-out FILE, or bench "
                                  "pp --calibrate, writes one) for --adaptive-lanes and "
                                  "--dynamic-chunks; default: the CPU values of ppstate.step_cost")

    @field_validator("step_cost")
    @classmethod
    def _check_step_cost(cls, v: str | None) -> str | None:
        if v is not None:
            load_step_cost(v)
        return v

    def replace(self, **changes: Any) -> "EngineConfig":
        """A validated copy with ``changes``: engine fields, or scheduler fields given flat
        (``config.replace(mode="sync", max_num_seqs=64)``).

        Raises:
            pydantic.ValidationError: a bad value, as the constructor.
        """
        return EngineConfig(**{**self.model_dump(), **changes})

    @model_validator(mode="before")
    @classmethod
    def _gather_scheduler(cls, data: Any) -> Any:
        """Flat scheduler fields and a partial ``scheduler`` dict become one scheduler dict over
        the engine's defaults (a :class:`SchedulerConfig` given alone is taken as it is)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        flat = {k: data.pop(k) for k in SCHEDULER_FIELDS if k in data}
        given = data.get("scheduler")
        if isinstance(given, SchedulerConfig):
            if not flat:
                return data
            given = dataclasses.asdict(given)
        values = {**ENGINE_SCHEDULER_DEFAULTS, **(given or {}), **flat}
        if flat.keys() & {"max_num_seqs", "max_model_len", "block_size"} and "num_kv_blocks" not in flat:
            values.pop("num_kv_blocks", None)  # derived again from the new sizes
        data["scheduler"] = values
        return data

    @field_validator("scheduler", mode="before")
    @classmethod
    def _check_scheduler_bounds(cls, v: Any) -> Any:
        values = dataclasses.asdict(v) if isinstance(v, SchedulerConfig) else v
        if isinstance(values, dict):
            for name, (low, high) in SCHEDULER_BOUNDS.items():
                x = values.get(name)
                if isinstance(x, int) and not isinstance(x, bool) and (
                        x < low or (high is not None and x > high)):
                    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
                    raise PydanticCustomError("engine_bound", "{field} must be {bound}, got {value}",
                                              {"field": name, "bound": bound, "value": x})
        return v

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_memory(cls, v: str | None) -> str | None:
        if v is not None:
            parse_kv_memory(v)
        return v

    @field_validator("validate_mirrors")
    @classmethod
    def _check_validate(cls, v: str) -> str:
        if v in ("every", "off") or (v.isdigit() and int(v) >= 1):
            return v
        raise ValueError("must be 'every', 'off' or a positive integer N (validate every N steps)")

    @model_validator(mode="after")
    def _check_budgets(self) -> "EngineConfig":
        if self.scheduler.max_prefill_chunk > self.scheduler.max_num_batched_tokens:
            raise ValueError("max_prefill_chunk must be <= max_num_batched_tokens")
        return self

    @property
    def world_size(self) -> int:
        """Rank processes of one pipeline: ``pp_size x tp_size`` (global rank
        ``pp_rank * tp_size + tp_rank``, docs/tp.md)."""
        return self.scheduler.pp_size * self.tp_size

    @property
    def result_rank(self) -> int:
        """The global rank whose StepResult the engine reads: TP rank 0 of the last stage."""
        return (self.scheduler.pp_size - 1) * self.tp_size

    @property
    def validate_every(self) -> int:
        """Steps between mirror validations (0 = off)."""
        if self.validate_mirrors == "off":
            return 0
        return 1 if self.validate_mirrors == "every" else int(self.validate_mirrors)


_UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_kv_memory(text: str) -> tuple[int | None, float | None]:
    """``(bytes, None)`` for ``"24MB"`` / ``"1048576"``, ``(None, fraction)`` for ``"0.9"``.

    Raises:
        ValueError: not a positive size with an optional KB/MB/GB suffix nor a fraction in (0, 1].
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if m is None:
        raise ValueError(f"{text!r} is neither a size like 24MB / 1073741824 nor a fraction in (0, 1]")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "" and "." in m.group(1):
        if not 0 < value <= 1:
            raise ValueError(f"fraction {text!r} must be in (0, 1]")
        return None, value
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r} must be a positive size")
    return size, None


def load_step_cost(path: str) -> dict[str, float]:
    """The step-cost coefficients in JSON file ``path``: ``results.step_cost`` of a ``bench
    contention`` or ``bench pp --calibrate`` result, or a flat object of
    :class:`ppstate.step_cost.StepCostModel` fields.

    Raises:
        ValueError: unreadable file, not JSON, or coefficients out of range.
    """
    import json
    from pathlib import Path
    from ppstate.step_cost import StepCostModel
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read step-cost file {path!r}: {exc}") from None
    data = doc.get("results", {}).get("step_cost", doc) if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} holds no step-cost coefficients")
    return StepCostModel.from_dict(data).to_dict()
