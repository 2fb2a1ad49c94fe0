"""Engine configuration (pydantic). CLI flags of ``runtime.serve`` / ``runtime.generate`` map 1:1."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class EngineConfig(BaseModel):
    """Everything needed to start a pipeline.

    Attributes:
        model: ``default`` (embedded SmolLM2-135M-Instruct GGUF), a .gguf file or an HF folder.
        pp_size: pipeline stages = worker processes.
        pp_layer_partition: manual layers per stage, e.g. ``"19,11"``; None balances by cost.
        pp_schedule: ``overlapped`` (bubble-free, pp_size + 1 batches in flight) or ``sync``
            (one batch in flight; the baseline).
        max_num_seqs: live requests at most (also the number of slots).
        max_model_len: prompt + output tokens per request at most.
        max_num_batched_tokens: tokens per step at most.
        max_prefill_chunk: prefill tokens of one request per step at most.
        validate_mirrors: ``every`` step, every N steps (``"4"``) or ``off``.
        device: ``cpu``, ``cuda`` or ``auto`` (cuda when available).
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (fp32 on CPU, bf16 on CUDA).
        torch_threads: torch intra-op threads per rank (CPU).
        step_timeout_s: seconds any collective, receive or step may take before the engine fails.
        heartbeat_timeout_s: seconds a rank may send nothing (each beats once a second, see
            :mod:`runtime.worker.heartbeat`) before the engine declares it dead or frozen and fails.
        trace_dir: record the run: a new ``run-*`` directory there with a header and one JSON-lines
            event file per process (None: off; docs/trace_format.md).
        trace_prompts: also record prompt token ids (otherwise only prompt lengths).
        served_model_name: name reported by /v1/models (default: derived from the model).
        launcher: ``spawn`` (the engine starts one process per rank on this machine) or
            ``torchrun`` (ranks are torchrun's processes, possibly on several machines; see
            :mod:`runtime.torchrun`).
        engine_port: torchrun only: the engine's TCP ports on the rank-0 host are
            ``engine_port`` (results) and ``engine_port + 1 + rank`` (steps of each rank).
        block_size: tokens per KV-cache block.
        kv_cache_memory: KV-cache memory per rank: bytes with an optional KB/MB/GB suffix
            (powers of 1024, e.g. ``24MB``), or a fraction in (0, 1] of the device memory free
            after the weights are loaded (CUDA only). None: room for ``max_model_len`` tokens in
            every slot (``max_num_seqs * ceil(max_model_len / block_size)`` blocks).
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes across requests.
        enforce_eager: CUDA: run decode steps eagerly instead of replaying captured CUDA graphs.
        spec_tokens: n-gram speculative decoding: draft tokens per decode row, ``K`` (0: off;
            :mod:`ppstate.spec_decode`).
        spec_ngram: n-gram length the proposer matches (tokens).
        dp_size: data-parallel replicas: independent pipelines of ``pp_size`` ranks each, behind
            one router (:mod:`runtime.dp.replicas`); ``dp_size * pp_size`` rank processes.
    """
    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    pp_size: int = Field(default=2, ge=1, le=64)
    pp_layer_partition: str | None = None
    pp_schedule: Literal["overlapped", "sync"] = "overlapped"
    max_num_seqs: int = Field(default=32, ge=1, le=4096)
    max_model_len: int = Field(default=2048, ge=16)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_prefill_chunk: int = Field(default=128, ge=1)
    validate_mirrors: str = "every"
    device: Literal["cpu", "cuda", "auto"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    torch_threads: int = Field(default=1, ge=1)
    step_timeout_s: float = Field(default=120.0, gt=0)
    heartbeat_timeout_s: float = Field(default=6.0, gt=1.0)
    trace_dir: str | None = None
    trace_prompts: bool = False
    served_model_name: str | None = None
    launcher: Literal["spawn", "torchrun"] = "spawn"
    engine_port: int = Field(default=29600, ge=1, le=65535 - 65)
    block_size: int = Field(default=16, ge=1, le=1024)
    kv_cache_memory: str | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # ---- data parallelism and speculative decoding (issue #14) ----
    dp_size: int = Field(default=1, ge=1, le=64)
    spec_tokens: int = Field(default=0, ge=0, le=16)
    spec_ngram: int = Field(default=3, ge=1, le=16)

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
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ValueError("max_prefill_chunk must be <= max_num_batched_tokens")
        return self

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
