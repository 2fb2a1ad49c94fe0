"""How many KV-cache blocks a rank allocates (``--kv-cache-memory``), and the startup summary.

Each rank sizes its own cache after loading its layers: ``bytes // bytes_per_block`` where a block
holds K and V of ``block_size`` tokens for the rank's layers. The engine's scheduler then uses the
smallest count over the ranks, so every block id it hands out exists on every rank.
"""

from __future__ import annotations

import torch

from runtime.config import EngineConfig, parse_kv_memory
from runtime.model.config import ModelConfig


def bytes_per_block(model_cfg: ModelConfig, num_local_layers: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """KV bytes of one block on a rank of ``num_local_layers`` layers (K and V, model dtype)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return num_local_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


def rank_num_blocks(cfg: EngineConfig, model_cfg: ModelConfig, num_local_layers: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    """Blocks this rank allocates.

    ``kv_cache_memory`` None: ``max_num_seqs * ceil(max_model_len / block_size)``; bytes: as many
    blocks as fit; fraction: that share of ``torch.cuda.mem_get_info`` free bytes (call after the
    weights are loaded).

    Raises:
        ValueError: a fraction on a non-CUDA device, or memory for less than one block; the
            message names ``--kv-cache-memory``.
    """
    if cfg.kv_cache_memory is None:
        return cfg.scheduler.max_num_seqs * -(-cfg.scheduler.max_model_len // cfg.scheduler.block_size)
    size, fraction = parse_kv_memory(cfg.kv_cache_memory)
    if fraction is not None:
        if device.type != "cuda":
            raise ValueError(f"--kv-cache-memory: a fraction ({cfg.kv_cache_memory}) needs a CUDA "
                             "device; give a size such as 24MB on the CPU")
        size = int(torch.cuda.mem_get_info(device)[0] * fraction)
    per = bytes_per_block(model_cfg, num_local_layers, cfg.scheduler.block_size, dtype)
    if size < per:
        raise ValueError(f"--kv-cache-memory: {cfg.kv_cache_memory} holds no block of "
                         f"{cfg.scheduler.block_size} tokens ({per} bytes on this rank)")
    return size // per


def capacity_summary(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """One log line: blocks, tokens and the max concurrency at ``max_model_len``."""
    tokens = num_blocks * block_size
    return (f"KV cache: {num_blocks} blocks x {block_size} tokens = {tokens} tokens per rank; "
            f"max concurrency at max_model_len {max_model_len}: {tokens / max_model_len:.2f}x")
