"""The pipeline plan: what every launcher derives from an :class:`EngineConfig` before any
process starts. Both launchers call :func:`plan_pipeline`: the spawn launcher's
:class:`~runtime.engine.launcher.WorkerPool` (through :meth:`AsyncEngine.start`) and every torchrun
rank (:mod:`runtime.engine.torchrun`), which computes the same plan locally without a handshake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.config import EngineConfig, parse_kv_memory
from runtime.device import uses_cuda
from runtime.model.config import ModelConfig
from runtime.model.partition import parse_partition, split_layers
from runtime.model.registry import resolve_model_path
from runtime.model.stage import load_model_config


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker process needs (passed to the spawned process by multiprocessing)."""
    rank: int
    config: dict
    layer_range: tuple[int, int]
    model_path: str
    init_method: str
    step_addr: str
    result_addr: str
    idle_exit_s: float | None = None  # exit after this many seconds without an engine message


@dataclass(frozen=True)
class PipelinePlan:
    """The resolved model and how its layers are cut.

    Attributes:
        model_path: the resolved model (GGUF file or HF folder).
        model_cfg: its configuration.
        layer_ranges: ``[pp_size]`` ``(start, end)`` decoder layers of each rank.
        served_name: the name /v1/models reports (``--served-model-name`` or derived from the path).
    """
    model_path: Path
    model_cfg: ModelConfig
    layer_ranges: list[tuple[int, int]]
    served_name: str


def plan_pipeline(config: EngineConfig) -> PipelinePlan:
    """Resolve the model and its config, check the resources, cut the layers, name the model.

    Raises:
        runtime.model.errors.ModelError: the model is missing, corrupt or unsupported.
        ValueError: a configuration that cannot work here (see :func:`check_resources`) or a bad
            ``--pp-layer-partition``; the message names the flag.
    """
    model_path = resolve_model_path(config.model)
    model_cfg = load_model_config(model_path)
    check_resources(config, model_cfg)
    if config.tp_size > 1:
        from runtime.model.tp.shard import check_tp
        check_tp(model_cfg, config.tp_size)
    return PipelinePlan(model_path, model_cfg, plan_layers(config, model_cfg),
                        config.served_model_name or served_name(model_path))


def plan_layers(config: EngineConfig, model_cfg: ModelConfig) -> list[tuple[int, int]]:
    """The ``(start, end)`` layers of every rank: ``--pp-layer-partition`` or the cost-balanced
    split. Deterministic, so torchrun ranks compute it locally without a handshake.

    Raises:
        ValueError: bad ``pp_layer_partition`` (message names ``--pp-layer-partition``).
    """
    n, pp = model_cfg.num_layers, config.scheduler.pp_size
    if config.pp_layer_partition:
        return parse_partition(config.pp_layer_partition, n, pp)
    measured = None
    if config.cpu_path == "fast" and not uses_cuda(config.device):   # quantized LM head: cheaper
        from runtime.model.cpu import HEAD_COST_LAYERS
        measured = (1.0, HEAD_COST_LAYERS)
    return split_layers(n, pp, model_cfg, measured=measured)


def check_resources(config: EngineConfig, model_cfg: ModelConfig) -> None:
    """Refuse, before any process starts, configurations that cannot work.

    Raises:
        ValueError: ``max_model_len`` beyond the model's context, CUDA asked for but absent, or
            (on CPU) KV caches larger than 80% of this machine's memory, a fractional
            ``--kv-cache-memory`` or ``--mirror-check-kernel fused`` without CUDA; names the flag.
    """
    if config.scheduler.max_model_len > model_cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len: {config.scheduler.max_model_len} exceeds the model's context "
                         f"length {model_cfg.max_position_embeddings}")
    if uses_cuda(config.device):
        return
    if config.mirror_check_kernel == "fused":   # the CPU ranks' mirror check has no CUDA graph
        raise ValueError("--mirror-check-kernel: fused applies to CUDA ranks only (inside their "
                         f"CUDA graph); this engine's ranks run on the CPU (--device "
                         f"{config.device}), where it would have no effect")
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if config.kv_cache_memory is not None:
        size, _ = parse_kv_memory(config.kv_cache_memory)
        if size is None:
            raise ValueError(f"--kv-cache-memory: a fraction ({config.kv_cache_memory}) needs a "
                             "CUDA device; give a size such as 24MB on the CPU")
        if size * config.world_size > 0.8 * mem:
            raise ValueError(f"--kv-cache-memory: {config.world_size} ranks x "
                             f"{config.kv_cache_memory} is more than 80% of this machine's "
                             f"{mem / 2**30:.1f} GiB")
        return
    elem = 2 if config.dtype in ("bfloat16", "float16") else 4
    kv = (2 * model_cfg.num_layers * config.scheduler.max_num_seqs * model_cfg.num_kv_heads
          * (-(-config.scheduler.max_model_len // config.scheduler.block_size) * config.scheduler.block_size)
          * model_cfg.head_dim * elem)
    if kv > 0.8 * mem:
        raise ValueError(
            f"--max-model-len / --max-num-seqs: KV caches of {config.scheduler.max_num_seqs} x "
            f"{config.scheduler.max_model_len} tokens need {kv / 2**30:.1f} GiB, more than 80% of this "
            f"machine's {mem / 2**30:.1f} GiB")


def served_name(model_path: str | Path) -> str:
    """Name reported by /v1/models: the GGUF file name without extension and quantisation
    suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), or the HF folder's
    name."""
    p = Path(model_path)
    if p.is_dir():
        return p.name
    stem = p.name[:-len(".gguf")] if p.name.endswith(".gguf") else p.stem
    head, _, tail = stem.rpartition(".")
    return head if head and (tail.upper().startswith(("Q", "F", "BF", "IQ"))) else stem
