"""--kv-cache-memory parsing, per-rank block counts, the startup line, and the CLI flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from runtime.cli_common import add_engine_flags, engine_config
from runtime.config import EngineConfig, parse_kv_memory
from runtime.model.config import ModelConfig
from runtime.worker.kv_capacity import bytes_per_block, capacity_summary, rank_num_blocks

CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("text, want", [("24MB", (24 * 2**20, None)), ("1048576", (2**20, None)),
                                        ("2KB", (2048, None)), ("1GB", (2**30, None)),
                                        ("0.9", (None, 0.9)), ("1.0", (None, 1.0))])
def test_parse_sizes_and_fractions(text, want):
    assert parse_kv_memory(text) == want


@pytest.mark.parametrize("text", ["1.5", "0.0", "abc", "-3MB", "12TB"])
def test_bad_values_are_refused(text):
    with pytest.raises(ValueError):
        parse_kv_memory(text)


def test_blocks_per_rank_from_bytes_and_default():
    per = bytes_per_block(CFG, 2, 16, torch.float32)
    assert per == 2 * 2 * 16 * 2 * 8 * 4
    cfg = EngineConfig(kv_cache_memory=f"{per * 7 + 5}", max_num_seqs=3, max_model_len=40)
    assert rank_num_blocks(cfg, CFG, 2, torch.float32, torch.device("cpu")) == 7
    default = EngineConfig(max_num_seqs=3, max_model_len=40, block_size=16)
    assert rank_num_blocks(default, CFG, 2, torch.float32, torch.device("cpu")) == 3 * 3
    with pytest.raises(ValueError, match="--kv-cache-memory: a fraction"):
        rank_num_blocks(EngineConfig(kv_cache_memory="0.5"), CFG, 2, torch.float32,
                        torch.device("cpu"))
    with pytest.raises(ValueError, match="--kv-cache-memory: 1KB holds no block of 16 tokens"):
        rank_num_blocks(EngineConfig(kv_cache_memory="1KB"), CFG, 2, torch.float32,
                        torch.device("cpu"))


def test_startup_line():
    assert capacity_summary(64, 16, 128) == ("KV cache: 64 blocks x 16 tokens = 1024 tokens per "
                                             "rank; max concurrency at max_model_len 128: 8.00x")


def test_cli_flags_and_error_naming_the_flag(capsys):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = engine_config(p, p.parse_args(["--block-size", "64", "--kv-cache-memory", "24MB",
                                         "--no-enable-prefix-caching", "--pp", "1"]))
    assert (cfg.scheduler.block_size, cfg.kv_cache_memory, cfg.scheduler.enable_prefix_caching) == (64, "24MB", False)
    with pytest.raises(SystemExit):
        engine_config(p, p.parse_args(["--kv-cache-memory", "lots", "--pp", "1"]))
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_resource_check_uses_the_kv_budget():
    from runtime.engine.plan import check_resources
    huge = dict(max_num_seqs=4096, max_model_len=8192, device="cpu")
    big = CFG.model_copy(update={"num_layers": 30, "max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="--max-model-len / --max-num-seqs"):
        check_resources(EngineConfig(**huge), big)
    check_resources(EngineConfig(kv_cache_memory="64MB", **huge), big)
    with pytest.raises(ValueError, match=r"--kv-cache-memory: a fraction \(0\.5\) needs a CUDA"):
        check_resources(EngineConfig(kv_cache_memory="0.5", device="cpu"), CFG)
