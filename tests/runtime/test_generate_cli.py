"""`python -m runtime.generate` user errors: one line naming the flag, no traceback, no workers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.plan import check_resources
from runtime.model.stage import load_model_config


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.generate", "--prompt", "Hello", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, rc, expected", [
    (["--pp-layer-partition", "10,10"], 1,
     "error: --pp-layer-partition '10,10' sums to 20 layers; the model has 30"),
    (["--model", "/nonexistent"], 1, "error: model path /nonexistent does not exist"),
    (["--max-tokens", "0"], 2, "error: --max-tokens: Input should be greater than or equal to 1"),
    (["--max-tokens", "99999"], 2,
     "error: --max-tokens: prompt 0 has 1 tokens; with --max-tokens 99999 that exceeds "
     "--max-model-len 2048"),
    (["--max-model-len", "999999"], 1,
     "error: --max-model-len: 999999 exceeds the model's context length 8192"),
])
def test_user_errors_are_one_line_naming_the_flag(args, rc, expected):
    res = _generate(*args)
    assert res.returncode == rc, res.stderr
    assert expected in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_any_worker_starts():
    res = _generate("--device", "cuda")
    assert res.returncode == 1
    assert "error: --device: cuda was asked for but torch sees no CUDA device" in res.stderr


def test_kv_cache_larger_than_memory_is_refused():
    cfg = load_model_config("default")
    with pytest.raises(ValueError, match=r"^--max-model-len / --max-num-seqs: KV caches of 4096 x "
                                         r"8192 tokens need 1440\.0 GiB"):
        check_resources(EngineConfig(max_num_seqs=4096, max_model_len=8192, device="cpu"), cfg)
    check_resources(EngineConfig(max_num_seqs=32, max_model_len=2048, device="cpu"), cfg)
