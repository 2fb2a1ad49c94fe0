"""The token mirror's incremental row digests (runtime/worker/token_check.py) equal the digests
recomputed from its host copy, after admissions and one-id and multi-id writes."""

import numpy as np
import torch

from runtime.worker.token_check import TokenMirror, position_weights


def _recomputed(tm: TokenMirror) -> list[int]:
    w = position_weights(tm.max_model_len)
    return (tm.ids_np.view(np.uint64) * w).sum(axis=1, dtype=np.uint64).tolist()


def test_incremental_digests_equal_the_recomputed_ones():
    tm = TokenMirror(4, 12, torch.device("cpu"))
    tm.resync(torch.zeros(4, 12, dtype=torch.int64))
    tm.admit(1, [5, 6, 7])
    tm.admit(3, [9])
    one = torch.tensor([[11], [12], [13]])          # one id per row: slots 1, 3, 0
    tm.record(one, np.array([1, 3, 0]), np.array([3, 1, 0]), np.array([1, 1, 1]))
    many = torch.tensor([[21, 22, 23], [31, 32, 33]])   # drafts: 3 and 2 ids, one row past the end
    tm.record(many, np.array([1, 2]), np.array([4, 10]), np.array([3, 3]))
    assert tm.ids_np[1, :7].tolist() == [5, 6, 7, 11, 21, 22, 23]
    assert tm.ids_np[2, 10:].tolist() == [31, 32]
    assert tm.ids_np[[3, 0], [1, 0]].tolist() == [12, 13]
    assert tm.digest_np.tolist() == _recomputed(tm)
    tm.record(torch.tensor([[40], [41]]), np.array([1, 3]), np.array([3, 1]), np.array([1, 1]))
    assert tm.ids_np[1, 3] == 40 and tm.ids_np[3, 1] == 41   # overwrites adjust the digest
    assert tm.digest_np.tolist() == _recomputed(tm)
