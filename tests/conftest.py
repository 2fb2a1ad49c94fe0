"""Shared pytest fixtures, and the tests' layout.

Tests are grouped by layer: ``core/`` (the ppstate core: machines, scheduler, PPHandler,
mirrors, specs), ``tools/`` (simulator, model checker, trace, replay, diagrams, the testing plugin,
packaging), ``runtime/`` (model, kernels, sampling, worker, engine, benchmarks), ``server/`` (the
HTTP server) and ``gpu/`` (the CUDA paths; skipped or CPU-only without a GPU). The helpers they share
(``engine_harness``, ``app_harness``, ``inproc_pipeline``, ``reference``) live in ``helpers/``,
which is put on ``sys.path`` here, so a test imports them by module name wherever it sits
(``from engine_harness import EngineThread``).

Model fixtures (tests/runtime/test_model_*.py): the default GGUF's config and all its tensors are
read once per session; stages of any layer range are then built from that dict without re-reading
the file.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

# The ppstate pytest plugin (sim_pipeline, pp_engine, --ppstate-trace-dir) is loaded through its
# pytest11 entry point once the package is installed; a checkout used through PYTHONPATH without
# `pip install -e .` (or installed before the entry point existed) loads it here instead.
PLUGIN = "runtime.testing.plugin"
if not any(ep.value == PLUGIN for ep in entry_points(group="pytest11")):
    pytest_plugins = [PLUGIN]


@pytest.fixture(scope="session")
def model_weights():
    """``(ModelConfig, {canonical name: fp32 tensor})`` of the whole default model."""
    from runtime.model.registry import resolve_model_path
    from runtime.model.tensor_names import stage_tensor_names
    from runtime.model.weights import load_tensors, open_checkpoint
    ckpt = open_checkpoint(resolve_model_path("default"))
    names = stage_tensor_names(ckpt.config, (0, ckpt.config.num_layers))
    return ckpt.config, load_tensors(ckpt, names, dtype=torch.float32, device="cpu", progress=False)


@pytest.fixture(scope="session")
def make_stages(model_weights):
    """``make_stages(ranges, max_num_reqs=8, max_model_len=256) -> [StageModel]`` (fresh KV caches)."""
    from runtime.model.stage import StageModel
    cfg, weights = model_weights

    def make(ranges, max_num_reqs: int = 8, max_model_len: int = 256):
        return [StageModel(cfg, r, weights, max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                           dtype=torch.float32, device="cpu").eval() for r in ranges]
    return make


@pytest.fixture(scope="session")
def served_engine():
    """One real engine (PP=2 worker processes, default model) with the server app in process,
    shared by tests/server/test_server_isolation.py and tests/server/test_server_features.py (see
    app_harness)."""
    from app_harness import AppEngine
    from runtime.config import EngineConfig
    eng = AppEngine(EngineConfig(pp_size=2, max_model_len=160, max_num_seqs=8, max_prefill_chunk=64,
                                 max_num_batched_tokens=256, step_timeout_s=120.0))
    yield eng
    eng.close()
