"""``python -m runtime.bench.gpu_attention``: the decode attention kernel alone, against dense
alternatives on the same GPU: the Triton paged kernel (shuffled blocks of 16 tokens, split-K as
chosen at run time), ``scaled_dot_product_attention`` over contiguous K/V (FlashAttention /
memory-efficient backends, GQA) and ``flex_attention`` (compiled) over contiguous K/V. The dense
ones need no block table, so they bound what paging costs. Median of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from runtime.model.kernels.attention import choose_num_splits, paged_attention


def case(rows: int, ctx: int, h: int, kvh: int, d: int, dev) -> dict:
    """Times (ms) of one decode step's attention: ``rows`` queries over ``ctx`` keys each."""
    import triton.testing as tt
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator(device=dev).manual_seed(0)
    bs = 16
    mb = ctx // bs
    kc = torch.randn(rows * mb, bs, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    bt = torch.randperm(rows * mb, device=dev, generator=g).view(rows, mb).int()
    q = torch.randn(rows, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    seq = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    splits = choose_num_splits(rows, kvh, ctx)
    out = torch.empty_like(q)
    t_paged = tt.do_bench(lambda: paged_attention(q, kc, vc, bt, seq, qsl, 1, d ** -0.5, splits, out),
                          return_mode="median")
    k = kc[bt.long()].reshape(rows, ctx, kvh, d).transpose(1, 2).contiguous()   # [R, KVH, L, D]
    v = vc[bt.long()].reshape(rows, ctx, kvh, d).transpose(1, 2).contiguous()
    q4 = q[:, :, None]                                                          # [R, H, 1, D]
    ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0]
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    t_sdpa = tt.do_bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
                         return_mode="median")
    try:
        flex = torch.compile(flex_attention, dynamic=False)
        flex(q4, k, v, enable_gqa=True)
        t_flex = tt.do_bench(lambda: flex(q4, k, v, enable_gqa=True), return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report, keep the other figures
        print(f"flex_attention failed: {exc!r}"[:300], flush=True)
        t_flex = None
    kv_bytes = 2 * rows * ctx * kvh * d * 2
    return {"rows": rows, "ctx": ctx, "heads": h, "kv_heads": kvh, "head_dim": d, "splits": splits,
            "triton_paged_ms": t_paged, "sdpa_dense_ms": t_sdpa, "flex_dense_ms": t_flex,
            "triton_paged_GBps": kv_bytes / t_paged / 1e6, "rel_err_vs_sdpa": err}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.gpu_attention", description=__doc__)
    p.add_argument("out", nargs="?", default=None, help="JSON file for the results (optional)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("python -m runtime.bench.gpu_attention needs a CUDA device")
    dev = torch.device("cuda")
    res = []
    for h, kvh, d in ((9, 3, 64), (32, 8, 128)):
        for rows, ctx in ((1, 4096), (128, 1024)):
            r = case(rows, ctx, h, kvh, d, dev)
            print(json.dumps(r), flush=True)
            res.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "cases": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
