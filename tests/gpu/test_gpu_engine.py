"""The real engine (scheduler, worker processes, runner) on CUDA with the fast path: greedy ids of
PP=1 with CUDA graphs, PP=1 ``--enforce-eager`` and PP=2 (overlapped; over NCCL with one GPU per
rank, or gloo with both ranks on one GPU)
equal transformers' on the same random-weight HF folder (top-1; a tolerance only on near-ties).

The folder is made here: the benchmark's SmolLM2-shaped random bf16 weights
(``runtime.bench.gpu_models``) saved by transformers, and a word-level tokenizer over the same
vocabulary (the engine only needs ids; the real tokenizer ships inside the GGUF, which does not
travel to GPU machines).
"""

from __future__ import annotations

import asyncio
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from runtime.bench.gpu_models import make_folder
    path = tmp_path_factory.mktemp("smollm2-random")
    return path, make_folder("smollm2-135m", path, torch.device("cuda", 0))


PROMPTS = [[100 + 7 * i + j for j in range(12 + 3 * i)] for i in range(4)]
NEW = 16


async def _generate(cfg) -> list[list[int]]:
    from runtime.engine import AsyncEngine
    from runtime.sampling_params import SamplingParams
    engine = await AsyncEngine.start(cfg)
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

        async def one(i, p):
            ids = []
            async for out in engine.add_request(f"g{i}", p, params):
                ids += out.new_token_ids
            return ids
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("pp,eager", [(1, False), (1, True), (2, False)])
def test_engine_greedy_equals_transformers(folder, pp, eager):
    # PP=2: NCCL with one GPU per rank; on a one-GPU machine both ranks share it over gloo
    from runtime.bench.gpu_hf import greedy_ids
    from runtime.config import EngineConfig
    path, hf = folder
    cfg = EngineConfig(model=str(path), pp_size=pp, device="cuda", dtype="bfloat16",
                       max_num_seqs=8, max_model_len=128, enforce_eager=eager,
                       mode="overlapped", engine_port=29700 + 10 * pp + eager)
    got = asyncio.run(_generate(cfg))
    matched = 0
    for p, ours in zip(PROMPTS, got):
        ref, scores = greedy_ids(hf, torch.tensor(p, device=hf.device), NEW)
        ref, scores = ref.tolist(), scores.cpu()
        assert len(ours) == NEW
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:   # must be a near-tie for transformers; the sequences diverge after it
                assert float(scores[i, b] - scores[i, a]) < NEAR_TIE, (p, i, a, b)
                break
            matched += 1
    assert matched >= len(PROMPTS) * NEW // 2
