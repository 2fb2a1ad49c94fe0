"""Slot-indexed sampling parameters (runtime/sampling/sampling_state.py) against the per-row build.

The reference is :meth:`runtime.sampling.batch.SamplingBatch.build` from the requests' own
``SamplingParams`` and output indices, and the pure-Python
:func:`runtime.sampling.batch.seeded_uniform`; a slot-gathered batch must give the same tokens,
logprobs and uniforms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppstate.batch import NewRequest
from runtime.sampling.batch import SamplingBatch, seeded_uniform
from runtime.sampling.penalties import TokenHistory
from runtime.sampling.sampler import sample
from runtime.sampling.sampling_state import SamplingState, seeded_uniform_t
from runtime.sampling_params import SamplingParams as SP
from runtime.worker.device_state import DeviceState

V = 4096


def test_device_splitmix_matches_python_bit_for_bit():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345] + rng.integers(0, 2**63 - 1, 60, dtype=np.int64).tolist()
    idx = [0, 1, 7, 2**40] + rng.integers(0, 10**6, 60).tolist()
    got = seeded_uniform_t(torch.tensor(seeds), torch.tensor(idx))
    ref = torch.tensor([seeded_uniform(s, i) for s, i in zip(seeds, idx)], dtype=torch.float64)
    assert torch.equal(got, ref)


PARAMS = [SP(temperature=0.0), SP(temperature=0.7, seed=11), SP(top_k=5, seed=3),
          SP(top_p=0.8, seed=5, logprobs=3), SP(temperature=1.3, top_k=40, top_p=0.9, seed=2**63 - 1),
          SP(temperature=0.0, logprobs=0), SP(seed=9, repetition_penalty=1.3, presence_penalty=0.5),
          SP(temperature=0.5, frequency_penalty=-1.0, seed=1), SP(top_p=0.999999999999, seed=4),
          SP(temperature=1e-30, seed=8)]


def _state(slots: list[int], prompt_lens: list[int]) -> SamplingState:
    st = SamplingState(16, torch.device("cpu"))
    st.admit(slots, PARAMS, prompt_lens)
    return st


def test_gathered_batch_samples_the_same_tokens_as_the_per_row_build():
    slots = [13, 2, 7, 0, 9, 4, 15, 11, 5, 1]
    prompt_lens = [3, 8, 1, 20, 5, 6, 2, 9, 4, 7]
    st = _state(slots, prompt_lens)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        order = np.random.default_rng(step).permutation(len(slots))      # rows in any order
        s = np.array(slots)[order]
        out_idx = np.array([step * 3 + j for j in range(len(slots))])
        pos_after = np.array(prompt_lens)[order] + out_idx
        logits = torch.randn(len(slots), V, generator=g) * 4
        hist = torch.randint(0, V, (len(slots), 32), generator=g)
        torch.manual_seed(100 + step)
        got, slots_t = st.batch(s, pos_after)
        assert torch.equal(slots_t, torch.as_tensor(s))
        torch.manual_seed(100 + step)
        ref = SamplingBatch.build([PARAMS[i] for i in order], out_idx.tolist(), "cpu")
        assert torch.equal(got.uniform, ref.uniform)
        for name in ("temperature", "top_k", "top_p", "greedy", "plain_rows", "cut_rows",
                     "penalty_rows", "presence", "frequency", "repetition"):
            a, b = getattr(got, name), getattr(ref, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        for name in ("max_top_k", "top_p_only", "max_num_logprobs", "num_greedy"):
            assert getattr(got, name) == getattr(ref, name), name
        history = None
        if ref.penalty_rows is not None:
            p = ref.penalty_rows
            history = TokenHistory(hist[p], torch.full((len(p),), 10), torch.full((len(p),), 20))
        a, b = sample(logits, got, history), sample(logits, ref, history)
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.top_logprobs[0], b.top_logprobs[0])


def test_device_state_admits_from_the_wire_dict_and_keeps_the_output_index_base():
    ds = DeviceState(8, 64, 1, torch.device("cpu"), rank=0)
    # a re-admitted request: 5 prompt tokens + 3 outputs it already had
    ds.add_requests([NewRequest("a", 6, tuple(range(8)), 40, SP(seed=77, top_k=3).model_dump(), 0, 3),
                     NewRequest("b", 1, (1, 2), 40, SP(temperature=0.0).model_dump(), 0, 0)])
    st = ds.sampling_state
    assert st.prompt_len[6].item() == 5 and st.prompt_len[1].item() == 2
    assert st.has_seed_np[6] and not st.has_seed_np[1] and st.temperature_np[1] == 0.0
    # output number 3 of "a" is sampled at position 8: its uniform is seeded_uniform(77, 3)
    batch, _ = st.batch(np.array([6]), np.array([8]))
    assert batch.uniform.item() == seeded_uniform(77, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gather_equals_cpu_gather():
    slots, prompt_lens = [3, 1, 0, 2, 4, 5, 6, 7, 8, 9], [4] * 10
    cpu, gpu = _state(slots, prompt_lens), SamplingState(16, torch.device("cuda"))
    gpu.admit(slots, PARAMS, prompt_lens)
    s, pos = np.array(slots), np.array([30 + j for j in range(10)])
    a, _ = cpu.batch(s, pos)
    b, _ = gpu.batch(s, pos)
    seeded = torch.from_numpy(cpu.has_seed_np[s])
    assert torch.equal(a.uniform[seeded], b.uniform.cpu()[seeded])
    assert torch.equal(a.temperature, b.temperature.cpu()) and torch.equal(a.top_k, b.top_k.cpu())
