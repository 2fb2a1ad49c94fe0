"""On CUDA: rank-local faults in a step's per-slot state caught within one step (issue #27).

The CPU test's faults (tests/runtime/test_mirror_state_faults.py) with every rank's state on the
GPU: the device fields and the block-id digests go through the asynchronous check (compared on
the device with the step's snapshot, one flag copied back), whose snapshot of the first step
after the fault names that step; it is raised while the following step finishes.
Skipped without CUDA. Without the default model's GGUF (a device machine), random weights of
its shape. The both-copies-wrong, each-field and last-rank tests run with both
``--mirror-check-kernel`` values (``graph``: torch kernels; ``fused``: one Triton kernel).
"""

from __future__ import annotations

import pytest
import torch

from mirror_faults import cut_maker, plant_and_catch, start, weights_or_random

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cut(request):
    return cut_maker(weights_or_random(request), "cuda")


@pytest.mark.parametrize("pp,rank", [(2, 1), (2, 0), (3, 1)])
def test_shifted_block_ids_caught_on_cuda(cut, pp, rank):
    err = plant_and_catch(start(cut(pp), "cuda"), rank, ("block_table_np", 1))
    assert err.field in ("block_ids (digest vs scheduler)", "block_table[0]"), str(err)


@pytest.mark.parametrize("kernel", ["graph", "fused"])
def test_both_copies_wrong_caught_by_the_digest_on_cuda(cut, kernel):
    err = plant_and_catch(start(cut(2), "cuda", kernel), 1, ("block_table_np", 1), ("block_table", 1),
                          reads=True)
    assert err.field == "block_ids (digest vs scheduler)"


@pytest.mark.parametrize("field,delta,named", [
    ("block_table", 1, "block_table[0]"),
    ("total_len", 1, "total_len"),
    ("sampling_state.f32", 0.25, "sampling.temperature"),
    ("sampling_state.i64", 1, "sampling.top_k"),
    ("num_computed_tokens", 2, "num_computed_tokens"),
    ("all_token_ids", 1, "all_token_ids["),
])
@pytest.mark.parametrize("kernel", ["graph", "fused"])
def test_fault_in_each_validated_field_on_cuda(cut, field, delta, named, kernel):
    err = plant_and_catch(start(cut(2), "cuda", kernel), 0, (field, delta))
    assert err.field.startswith(named) and err.cpu != err.device, str(err)


@pytest.mark.parametrize("field,delta,named", [
    ("all_token_ids", 1, "all_token_ids["),
    ("total_len", 1, "total_len"),
    ("num_computed_tokens", 2, "num_computed_tokens"),
])
@pytest.mark.parametrize("kernel,traced", [("graph", False), ("fused", False), ("graph", True)])
def test_fault_on_the_last_rank_on_cuda(cut, field, delta, named, kernel, traced, tmp_path):
    """The last rank's check: untraced, its snapshot runs after the step's result
    (``StageRunner.run_deferred_check``, the token mirror's ids taken from the result copy);
    traced, it rides on the result copy (snapshot before it, its event for the check's). Either
    way caught within one step, naming the field."""
    pipe = start(cut(2), "cuda", kernel)
    if traced:   # the last rank records a trace from here on
        from ppstate.events import JsonlSink
        last = pipe.runners[1]
        sink = JsonlSink(tmp_path / "rank1.jsonl")
        last.sink = last.step_order.sink = last.mirrors.sink = last.mirrors.check.sink = sink
    err = plant_and_catch(pipe, 1, (field, delta))
    assert err.field.startswith(named) and err.cpu != err.device and err.rank == 1, str(err)


def test_fused_check_sets_the_same_flag_as_the_graph_on_random_layouts():
    """The fused kernel compiled for CUDA against the torch flag (the interpreter test's cases,
    tests/runtime/test_mirror_check_kernel.py, at 256 slots and 40 columns)."""
    from mirror_check_cases import EXPECT, FAULTS, _case, _plant, _torch_flag

    from runtime.worker.kernels.mirror_check_kernel import fused_check
    for fault in FAULTS:
        for slot in (0, 130, 255):
            case = [x.cuda() if isinstance(x, torch.Tensor) else x for x in _case(3, 256, 40, 9000)]
            if fault != "none":
                _plant(case, fault, slot)
            ref, ref_dig = _torch_flag(*case)
            dig = torch.full((256,), -1, dtype=torch.int64, device="cuda")
            flag = torch.ones(1, dtype=torch.bool, device="cuda")
            fused_check(*case, dig, flag, 16, 2)
            assert (bool(flag[0]), ref) == (EXPECT[fault], EXPECT[fault]), (fault, slot)
            assert torch.equal(dig, ref_dig), (fault, slot)
