"""``python -m runtime.bench mirror --device host`` runs the CUDA check's host path on the CPU
(runtime/bench/mirror_host.py): the token mirror records each step's ids for later, takes them
from the result copy and applies them a step later; every step is compared; the masks and the
expected values land in the check's buffer as on CUDA."""

import numpy as np

from runtime.bench.mirror_host import host_loop


def test_host_loop_takes_the_cuda_path_and_keeps_the_token_copy_exact():
    loop = host_loop(4, 8, 64, None)
    tokens = loop.token_mirror
    assert tokens.device.type == "cuda" and loop.check._pin
    loop.block(5, True)                        # 5 steps, then finish(): the last one compared
    assert loop.check.checked_steps == 5 and not loop.check.pending and not tokens.pending
    st = loop.state
    assert np.array_equal(tokens.ids_np, st.all_token_ids.numpy())
    assert st.total_len_np.tolist() == [13] * 4          # 8 prompt ids + 5 sampled
    assert tokens.ids_np[:, 8:13].tolist() == [[7] * 5] * 4
    live, rows, digests = loop.check.dev.aux_rows[4 % 2]   # the last step's buffer
    assert live.tolist() == [1, 1, 1, 1] and rows.tolist() == [1, 1, 1, 1]
    assert digests.tolist() == loop.digests.of(loop.slots).view(np.int64).tolist()
    exp = loop.check.dev.expected(0, loop.check._graph_size)
    assert np.array_equal(exp, st.host_flat)               # step 4 wrote buffer 0 last

