"""CPU GEMM candidates for the quantized fast path on the real SmolLM2-135M shapes: torch fp32
``F.linear`` (the reference), torch's weight-only int4 (``_weight_int4pack_mm_for_cpu``, 32-value
groups) and int8 (``_weight_int8pack_mm``, per-channel) kernels, and ONNX Runtime's
``MatMulNBits`` at accuracy levels 1 (fp32 compute) and 4 (int8 activations), over the GGUF's own
blocks. Kernels are timed in turn round by round (A B C ...) so machine load hits them alike;
report the per-token ratios.

Usage: ``python -m runtime.bench.cpu_kernels [--rows 1,8,64,256] [--threads 1] [--json-out F]``
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from runtime.model.cpu.gguf_blocks import from_gguf, requantize
from runtime.model.cpu.ort_linear import QuantLinear
from runtime.model.cpu.sessions import init_threads
from runtime.model.gguf_file import tensor_data
from runtime.model.registry import default_model_path
from runtime.model.weights import open_checkpoint

# (label, GGUF tensor) per layer GEMM; the LM head is the tied Q8_0 embedding
SHAPES = [("qkv-q", "blk.0.attn_q.weight"), ("o", "blk.0.attn_output.weight"),
          ("gate", "blk.0.ffn_gate.weight"), ("down", "blk.0.ffn_down.weight"),
          ("lm_head", "token_embd.weight")]


def _kernels(raw, ggml_type, n, k, torch_int4: bool):
    """name -> callable(x) for one weight."""
    bw = from_gguf(raw, ggml_type, n, k)
    w = torch.from_numpy(bw.dequantize())
    out = {"torch_fp32": lambda x: F.linear(x, w)}
    q = torch.from_numpy(bw.packed)
    if bw.bits == 4 and torch_int4:
        vals = torch.stack([q & 15, q >> 4], -1).reshape(n, k).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(vals, 1)
        s = torch.from_numpy(bw.scales).view(n, k // 32)
        zp = torch.from_numpy(bw.zero_points).view(n, k // 32)
        sz = torch.stack([s, (8 - zp) * s], -1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        out["torch_int4"] = lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    if torch_int4:
        out["torch_int8_channel"] = lambda x: torch._weight_int8pack_mm(x, w8, scale)
    if bw.bits == 4:   # float zero points (exact Q4_1)
        out["ort_q4_1_float_zp_level4"] = QuantLinear(bw, accuracy_level=4)
    for bits in (4, 8):
        rq = requantize(bw, bits)
        for level in (1, 4):
            out[f"ort_int{bits}_level{level}"] = QuantLinear(rq, accuracy_level=level)
    return out, w


def run(rows: list[int], rounds: int, min_s: float, torch_wo: bool) -> dict:
    ckpt = open_checkpoint(default_model_path())
    results = []
    for label, name in SHAPES:
        t = ckpt.tensors[name]
        n, k = int(t.dims[1]), int(t.dims[0])
        kern, w = _kernels(tensor_data(ckpt._mm, t), t.ggml_type, n, k, torch_wo)
        for m in rows:
            x = torch.randn(m, k)
            ref = F.linear(x, w)
            err = {nm: float((f(x) - ref).abs().max() / ref.abs().max()) for nm, f in kern.items()}
            times = {nm: [] for nm in kern}
            for _ in range(rounds):
                for nm, f in kern.items():
                    reps, t0 = 0, time.perf_counter()
                    while True:
                        f(x)
                        reps += 1
                        if time.perf_counter() - t0 > min_s:
                            break
                    times[nm].append((time.perf_counter() - t0) / reps * 1e6)
            med = {nm: float(np.median(v)) for nm, v in times.items()}
            results.append({"gemm": label, "n": n, "k": k, "rows": m,
                            "us": {nm: round(v, 1) for nm, v in med.items()},
                            "speedup_vs_fp32": {nm: round(med["torch_fp32"] / v, 2)
                                                for nm, v in med.items()},
                            "rel_err": {nm: round(v, 5) for nm, v in err.items()}})
            print(label, n, k, m, {nm: f"{v:.0f}us x{med['torch_fp32'] / v:.2f}"
                                   for nm, v in med.items()}, flush=True)
    return {"bench": "cpu_kernels", "torch": torch.__version__,
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                       f"torch threads", "rounds": rounds, "results": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.15)
    ap.add_argument("--torch-weight-only", action="store_true",
                    help="also time torch's int4 / int8 weight-only kernels (slow here)")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    init_threads(a.threads)
    res = run([int(r) for r in a.rows.split(",")], a.rounds, a.min_s, a.torch_weight_only)
    res["threads"] = a.threads
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
