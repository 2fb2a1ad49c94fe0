"""ONNX graphs of the GEMM-heavy part of a stage, one session per segment between two attentions.

A stage's step alternates attention (torch, over the paged KV cache) with a *segment* run by ONNX
Runtime: everything from one layer's attention output to the next layer's QKV projection, so a
layer costs one ONNX Runtime call. With ``x``, ``res`` ``[T, H]``:

* ``head``: ``res' = x + res``; ``qkv = norm1_0(res') @ Wqkv_0^T``  -> ``(q, kv, res')``
* ``mid i``: ``h = attn @ Wo_i^T``; ``res' = h + res``; ``m = down_i(silu(g) * u)`` with
  ``(g, u) = norm2_i(res') @ Wgu_i^T``; ``res'' = m + res'``; ``qkv = norm1_{i+1}(res'') @ Wqkv^T``
  -> ``(q, kv, res'')``

Where a segment ends in a QKV projection it also applies RoPE (``RotaryEmbedding``, half-split
pairing as ``layers.apply_rope``) to the queries and keys with the step's ``cos``, ``sin``
``[T, D / 2]`` (the rows of the stage's tables at each token's position; ``pos`` is ``[[0 .. T-1]]``
into them) and returns ``q [T, NH D]`` and ``kv [2, T, KVH D]`` (rotated keys, values), the layout of
one layer's KV cache viewed ``[2, blocks * block_size, KVH D]``, so the attention writes both with
one ``index_copy_``.
* ``tail``: as ``mid`` up to ``m``; a non-last stage returns ``(m, res')`` (the carried-residual
  convention of ``runtime.model.layers``), the last stage gathers each row's last token
  (``rows [R]``) and returns ``logits [R, V] = norm_f(m + res') @ W_head^T``.

GEMMs are ``MatMulNBits`` (com.microsoft; int8 activations at ``accuracy_level`` 4), add + RMSNorm
is ``SkipSimplifiedLayerNormalization`` (fp32), SiLU is ``x * sigmoid(x)``.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from runtime.model.cpu.gguf_blocks import BLOCK, BlockWeight
from runtime.model.cpu.sessions import open_session

MS = "com.microsoft"


class _Builder:
    """Accumulates nodes and initializers of one graph."""

    def __init__(self, accuracy_level: int, eps: float) -> None:
        self.nodes, self.inits, self.level, self.eps, self._n = [], [], accuracy_level, eps, 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, arr: np.ndarray, stem: str) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def matmul(self, x: str, w: BlockWeight) -> str:
        """``x [T, K] @ w^T -> [T, N]``."""
        ins = [x, self.const(w.packed, "B"), self.const(w.scales, "scales")]
        if w.zero_points is not None:
            ins.append(self.const(w.zero_points, "zp"))
        out = self.name("mm")
        self.nodes.append(helper.make_node("MatMulNBits", ins, [out], domain=MS, K=w.k, N=w.n,
                                           bits=w.bits, block_size=BLOCK,
                                           accuracy_level=self.level))
        return out

    def add_norm(self, x: str, res: str, gamma: np.ndarray) -> tuple[str, str]:
        """``(norm(x + res) * gamma, x + res)``."""
        out, total = self.name("normed"), self.name("res")
        self.nodes.append(helper.make_node(
            "SkipSimplifiedLayerNormalization", [x, res, self.const(gamma, "gamma")],
            [out, "", "", total], domain=MS, epsilon=self.eps))
        return out, total

    def mlp(self, x: str, res: str, layer) -> tuple[str, str]:
        """``(down(silu(g) * u), res')`` from an attention output ``x``."""
        normed, res = self.add_norm(self.matmul(x, layer.o), res, layer.ln2)
        gu = self.matmul(normed, layer.gate_up)
        g, u = self.name("gate"), self.name("up")
        half = layer.gate_up.n // 2
        self.nodes.append(helper.make_node("Split", [gu, self.const(np.array([half, half]), "sp")],
                                           [g, u], axis=-1))
        sig, act, prod = self.name("sig"), self.name("act"), self.name("prod")
        self.nodes += [helper.make_node("Sigmoid", [g], [sig]),
                       helper.make_node("Mul", [g, sig], [act]),
                       helper.make_node("Mul", [act, u], [prod])]
        return self.matmul(prod, layer.down), res

    def rope_qkv(self, normed: str, w: BlockWeight, heads: tuple[int, int, int]) -> tuple[str, str]:
        """``normed [T, H] -> (q [T, NH D], kv [2, T, KVH D])``: QKV GEMM, RoPE on q and k."""
        nh, kvh, d = heads
        qkv = self.matmul(normed, w)
        qk, v, qk3, rot3, rot, q, k = (self.name(n) for n in ("qk", "v", "qk3", "rot3", "rot", "q", "k"))
        ax0 = self.const(np.array([0], dtype=np.int64), "ax0")
        self.nodes += [
            helper.make_node("Split", [qkv, self.const(np.array([(nh + kvh) * d, kvh * d]), "sp")],
                             [qk, v], axis=-1),
            helper.make_node("Unsqueeze", [qk, ax0], [qk3]),
            helper.make_node("RotaryEmbedding", [qk3, "pos", "cos", "sin"], [rot3], domain=MS,
                             interleaved=0, num_heads=nh + kvh),
            helper.make_node("Squeeze", [rot3, ax0], [rot]),
            helper.make_node("Split", [rot, self.const(np.array([nh * d, kvh * d]), "sp")], [q, k],
                             axis=-1)]
        k0, v0, kv = self.name("k0"), self.name("v0"), self.name("kv")
        self.nodes += [helper.make_node("Unsqueeze", [k, ax0], [k0]),
                       helper.make_node("Unsqueeze", [v, ax0], [v0]),
                       helper.make_node("Concat", [k0, v0], [kv], axis=0)]
        return q, kv

    def session(self, inputs: list[tuple[str, int, list]], outputs: dict[str, tuple[str, list]],
                ) -> ort.InferenceSession:
        """Finish the graph (renaming the chosen values to the output names) and open it."""
        for out_name, (value, _) in outputs.items():
            self.nodes.append(helper.make_node("Identity", [value], [out_name]))
        graph = helper.make_graph(
            self.nodes, "segment",
            [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
             for n, (_, s) in outputs.items()], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid(MS, 1)])
        model.ir_version = 9
        return open_session(model.SerializeToString())


_F = TensorProto.FLOAT


def _rope_inputs(d: int) -> list[tuple[str, int, list]]:
    return [("pos", TensorProto.INT64, [1, "T"]), ("cos", _F, ["T", d // 2]), ("sin", _F, ["T", d // 2])]


def _qkv_outputs(q: str, kv: str, heads: tuple[int, int, int]) -> dict:
    nh, kvh, d = heads
    return {"q": (q, ["T", nh * d]), "kv": (kv, [2, "T", kvh * d])}


def head_segment(layer, heads: tuple[int, int, int], level: int, eps: float,
                 ) -> ort.InferenceSession:
    """``(x, res, pos, cos, sin) -> (q, kv, res)`` into ``layer``'s attention; ``heads`` is
    ``(NH, KVH, D)``."""
    b = _Builder(level, eps)
    h = layer.ln1.shape[0]
    normed, res = b.add_norm("x", "res", layer.ln1)
    q, kv = b.rope_qkv(normed, layer.qkv, heads)
    return b.session([("x", _F, ["T", h]), ("res", _F, ["T", h])] + _rope_inputs(heads[2]),
                     {**_qkv_outputs(q, kv, heads), "res_out": (res, ["T", h])})


def mid_segment(layer, nxt, heads: tuple[int, int, int], level: int, eps: float,
                ) -> ort.InferenceSession:
    """``(attn, res, pos, cos, sin) -> (q, kv, res)``: rest of ``layer``, start of ``nxt``."""
    b = _Builder(level, eps)
    h = layer.ln1.shape[0]
    m, res = b.mlp("x", "res", layer)
    normed, res = b.add_norm(m, res, nxt.ln1)
    q, kv = b.rope_qkv(normed, nxt.qkv, heads)
    return b.session([("x", _F, ["T", layer.o.k]), ("res", _F, ["T", h])] + _rope_inputs(heads[2]),
                     {**_qkv_outputs(q, kv, heads), "res_out": (res, ["T", h])})


def tail_segment(layer, level: int, eps: float, head: tuple[np.ndarray, BlockWeight] | None,
                 ) -> ort.InferenceSession:
    """``(attn, res) -> (hidden, res)``, or with ``head`` (final norm, LM head)
    ``(attn, res, rows) -> logits [R, V]``."""
    b = _Builder(level, eps)
    h = layer.ln1.shape[0]
    m, res = b.mlp("x", "res", layer)
    inputs = [("x", _F, ["T", layer.o.k]), ("res", _F, ["T", h])]
    if head is None:
        return b.session(inputs, {"hidden": (m, ["T", h]), "res_out": (res, ["T", h])})
    norm, w = head
    gm, gr = b.name("gm"), b.name("gr")
    b.nodes += [helper.make_node("Gather", [m, "rows"], [gm], axis=0),
                helper.make_node("Gather", [res, "rows"], [gr], axis=0)]
    normed, _ = b.add_norm(gm, gr, norm)
    return b.session(inputs + [("rows", TensorProto.INT64, ["R"])],
                     {"logits": (b.matmul(normed, w), ["R", w.n])})
