"""Planting rank-local faults in a step's per-slot state and catching them (issue #27): shared by
tests/runtime/test_mirror_state_faults.py (CPU) and tests/gpu/test_gpu_mirror_state_faults.py.

A 3-layer cut of the embedded model runs in one process (inproc_pipeline.py); the fault is planted
with the engine's own ``corrupt_state`` hook (``DeviceState.corrupt``) on one rank's slot of the
victim request, and the pipeline is ticked until a step raises ``MirrorDivergence``.
"""

from __future__ import annotations

import pytest
import torch

from inproc_pipeline import InprocPipeline
from ppstate.errors import MirrorDivergence
from runtime.sampling_params import SamplingParams

PROMPT = [504, 3458, 282, 4649, 314, 1167, 30, 216, 9400, 2067, 1205, 253, 1345, 11, 7630, 28, 457]
MAX_TICKS = 60


def cut_maker(model_weights, device: str = "cpu"):
    """``make(pp)``: StageModels of the first 3 layers of the embedded model on ``device`` (final
    norm and the tied head on the last stage), (0, 1) / (1, 3) at PP=2, one layer per rank at
    PP=3; built once per PP."""
    from runtime.model.stage import StageModel
    cfg, weights = model_weights
    small = cfg.model_copy(update={"num_layers": 3})
    built: dict[int, list] = {}

    def make(pp: int) -> list:
        if pp not in built:
            ranges = [(0, 1), (1, 3)] if pp == 2 else [(0, 1), (1, 2), (2, 3)]
            built[pp] = [StageModel(small, r, weights, max_num_reqs=2, max_model_len=96,
                                    dtype=torch.float32, device=device).eval() for r in ranges]
        return built[pp]
    return make


def weights_or_random(request) -> tuple:
    """The ``model_weights`` fixture's ``(config, weights)``, or, where the default model is not
    installed (a device machine without its GGUF), random weights of its shape (SmolLM2-135M,
    runtime/bench/gpu_models.py) for the first 3 layers: the faults and the checks that catch
    them depend on the state's bookkeeping, not on the trained values."""
    from runtime.model.errors import ModelNotFoundError
    try:
        return request.getfixturevalue("model_weights")
    except ModelNotFoundError:
        from runtime.bench.gpu_models import model_config, random_tensor
        from runtime.model.tensor_names import stage_tensor_names
        cfg = model_config("smollm2-135m")
        small = cfg.model_copy(update={"num_layers": 3})
        return cfg, {n: random_tensor(cfg, n, torch.device("cpu"), torch.float32)
                     for n in stage_tensor_names(small, (0, 3))}


def start(stages: list, device: str = "cpu", check_kernel: str = "graph") -> InprocPipeline:
    """A pipeline over ``stages`` running a seeded "victim" and a greedy "other" request, ticked
    until the victim has 4 tokens (prefill in chunks of 8, then decodes); ``check_kernel``: the
    CUDA check's ``--mirror-check-kernel``."""
    pipe = InprocPipeline(stages, max_num_seqs=2, max_model_len=96, max_prefill_chunk=8,
                          device=device, check_kernel=check_kernel)
    pipe.add("victim", PROMPT, SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=3,
                                              ignore_eos=True))
    pipe.add("other", PROMPT[:9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    pipe.run_until(lambda p: len(p.tokens["victim"]) >= 4, MAX_TICKS)
    return pipe


def device_of(pipe: InprocPipeline) -> str:
    """The device type the pipeline's ranks run on ("cpu" or "cuda")."""
    return torch.device(pipe.runners[0].state.device).type


def plant_and_catch(pipe: InprocPipeline, rank: int, *corruptions: tuple[str, float],
                    reads: bool = False) -> MirrorDivergence:
    """Plant ``corruptions`` (field, delta) on ``rank``'s slot of the victim; tick until a step
    raises. Asserts the error is about the first step ``rank`` runs afterwards (with ``reads``:
    the first with a row of the victim, i.e. that reads its table) and names rank, slot and
    request (on CUDA the asynchronous check raises it while the following step finishes)."""
    slot = pipe.sched.slots.lookup("victim")
    state = pipe.runners[rank].state
    for field, delta in corruptions:
        state.corrupt(slot, field, delta)
    before = pipe.runners[rank].running_step
    with pytest.raises(MirrorDivergence) as info:
        pipe.run_until(lambda p: False, MAX_TICKS)
    err = info.value
    issued = [o.step for o in pipe.steps if o.step > before and
              (not reads or "victim" in o.req_ids)]
    reading = [o.step for o in pipe.steps if o.step > before and "victim" in o.req_ids]
    assert err.rank == rank and err.slot == slot and err.req_id == "victim", str(err)
    # the next step; on CUDA the after-step comparison of a step without the victim's row lands
    # while the following step runs, so there the digest may name the first step that reads it
    assert err.step == issued[0] or (device_of(pipe) == "cuda" and err.step == reading[0]), \
        (before, issued, reading, str(err))
    assert f"rank {rank} step {err.step}" in str(err) and f"slot {slot}" in str(err)
    return err
