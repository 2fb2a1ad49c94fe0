"""The GPU fast path over one TP rank's slice (:class:`runtime.model.tp.paged.TPPagedStage`), run on
the CPU through the kernels' torch backend: two forked processes over gloo, each holding its TP
rank's slice (heads, KV heads, intermediate and vocabulary split), give transformers' logits for a
prefill of 2 rows and 2 decode steps. The CUDA graphs of this path (piecewise over gloo,
runtime/worker/tp_graphs.py) run on the GPU only: tests/gpu/test_gpu_tp.py.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest
import torch

from families import build_family_model


def _rank(rank: int, port: int, folder: str, ids: torch.Tensor, out) -> None:
    """TP rank ``rank`` of 2: prefill ``ids [2, P]`` then 2 greedy decode steps; puts
    ``(rank, [logits of each step])``."""
    import torch.distributed as dist

    from runtime.model.paged_stage import PagedMeta
    from runtime.model.tp.comm import TPComm
    from runtime.model.tp.paged import TPPagedStage
    from runtime.model.tp.stage import load_tp_stage
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm = TPComm(dist.group.WORLD, 2, rank)
        stage = load_tp_stage(folder, (0, 2), comm, max_num_reqs=1, max_model_len=16,
                              progress=False, batch_invariant=False, block_size=4, num_blocks=1)
        model = TPPagedStage(stage, num_blocks=16, max_model_len=32)
        bt = np.random.default_rng(0).permutation(16)[:10].reshape(2, 5)
        dev, p = torch.device("cpu"), ids.shape[1]
        kvh = stage.cfg.num_kv_heads
        logits = model.forward(PagedMeta.build(bt, [0, 0], [p, p], 4, dev, kvh),
                               input_ids=ids.reshape(-1))
        got = [logits]
        for step in range(2):
            nxt = logits.argmax(-1)
            logits = model.forward(PagedMeta.build(bt, [p + step] * 2, [1, 1], 4, dev, kvh),
                                   input_ids=nxt)
            got.append(logits)
        out.put((rank, [g.numpy() for g in got]))   # numpy: pickled whole, not fd-shared
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}),                                            # q/k/v biases, 2 KV heads: 1 each
    ("qwen3_moe", {"num_key_value_heads": 1, "vocab_size": 509}),   # KV head replicated, padding
])
def test_tp2_fast_path_matches_transformers(family, overrides, tmp_path):
    hf = build_family_model(family, tmp_path, layers=2, **overrides)
    vocab = hf.config.vocab_size
    ids = torch.randint(2, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), random.Random().randrange(40000, 50000)
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), ids, out)) for r in range(2)]
    for pr in procs:
        pr.start()
    got = {r: [torch.from_numpy(x) for x in xs] for r, xs in (out.get(timeout=120) for _ in procs)}
    for pr in procs:
        pr.join(30)
    assert [pr.exitcode for pr in procs] == [0, 0]
    for a, b in zip(got[0], got[1]):       # both TP ranks hold the same full logits
        assert a.shape == (2, vocab) and torch.equal(a, b)
    for logits in got[0]:
        with torch.no_grad():
            ref = hf(ids).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        ids = torch.cat([ids, logits.argmax(-1)[:, None]], 1)
