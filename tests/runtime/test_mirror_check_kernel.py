"""The fused mirror-check kernel (runtime/worker/kernels/mirror_check_kernel.py) under Triton's
interpreter: its flag and digests equal the torch path's (CheckGraph mode ``graph``) bit for bit on
random layouts, healthy and with each kind of fault planted (tests/helpers/mirror_check_cases.py).
The asynchronous check in mode ``fused`` names the same faults as in mode ``graph``
(tests/runtime/test_mirror_check_layout.py)."""

import pytest
import torch

from mirror_check_cases import BS, EXPECT, FAULTS, SLACK, _case, _plant, _torch_flag
from runtime.worker.kernels.mirror_check_kernel import fused_check, tile_shape


@pytest.mark.parametrize("seed,n,cols,size", [(0, 8, 5, 300), (1, 130, 37, 2500), (2, 3, 1, 7),
                                               (3, 40, 200, 4200)])
def test_fused_flag_equals_the_torch_flag(seed, n, cols, size):
    """Every fault kind at the first, a middle and the last slot (tile edges: 64 slots of 64
    columns, 16 slots of 256 columns, 2048 words): the same flag as the torch path, the expected
    one, and the same digests."""
    for fault in FAULTS:
        for slot in sorted({0, n // 2, n - 1}):
            case = _case(seed, n, cols, size)
            if fault != "none":
                _plant(case, fault, slot)
            ref, ref_dig = _torch_flag(*case)
            dig = torch.full((n,), -1, dtype=torch.int64)
            flag = torch.tensor([True])
            fused_check(*case, dig, flag, BS, SLACK)
            assert (bool(flag[0]), ref) == (EXPECT[fault], EXPECT[fault]), (fault, slot)
            assert torch.equal(dig, ref_dig), (fault, slot)


def test_tile_shape():
    """Digest tiles: every column of a row in one tile (a power of two), about 4096 ids a tile."""
    assert [tile_shape(c) for c in (1, 5, 24, 64, 65, 200, 2048, 8192)] == [
        (64, 1), (64, 8), (64, 32), (64, 64), (32, 128), (16, 256), (2, 2048), (1, 8192)]


def test_fused_rejects_mismatched_shapes():
    snap, exp, held, computed, aux, table, w, w0 = _case(0, 4, 3, 50)
    with pytest.raises(ValueError, match="fused_check: shapes"):
        fused_check(snap, exp[:-1], held, computed, aux, table, w, w0,
                    torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.bool), BS, SLACK)
