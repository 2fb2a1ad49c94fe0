"""ONNX graphs of the GEMM-heavy part of a stage, one session per segment between two attentions.

A stage's step alternates attention (torch, over the paged KV cache) with a *segment* run by ONNX
Runtime: everything from one layer's attention output to the next layer's QKV projection, so a
layer costs one ONNX Runtime call. With ``x``, ``res`` ``[T, H]``:

* ``head``: ``res' = x + res``; ``qkv = norm1_0(res') @ Wqkv_0^T``  -> ``(qkv, res')``
* ``mid i``: ``h = attn @ Wo_i^T``; ``res' = h + res``; ``m = down_i(silu(g) * u)`` with
  ``(g, u) = norm2_i(res') @ Wgu_i^T``; ``res'' = m + res'``; ``qkv = norm1_{i+1}(res'') @ Wqkv^T``
  -> ``(qkv, res'')``
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


def head_segment(layer, level: int, eps: float) -> ort.InferenceSession:
    """``(x, res) -> (qkv, res)`` into ``layer``'s attention."""
    b = _Builder(level, eps)
    normed, res = b.add_norm("x", "res", layer.ln1)
    return b.session([("x", _F, ["T", layer.ln1.shape[0]]), ("res", _F, ["T", layer.ln1.shape[0]])],
                     {"qkv": (b.matmul(normed, layer.qkv), ["T", layer.qkv.n]),
                      "res_out": (res, ["T", layer.ln1.shape[0]])})


def mid_segment(layer, nxt, level: int, eps: float) -> ort.InferenceSession:
    """``(attn, res) -> (qkv, res)``: rest of ``layer``, start of ``nxt``."""
    b = _Builder(level, eps)
    h = layer.ln1.shape[0]
    m, res = b.mlp("x", "res", layer)
    normed, res = b.add_norm(m, res, nxt.ln1)
    return b.session([("x", _F, ["T", layer.o.k]), ("res", _F, ["T", h])],
                     {"qkv": (b.matmul(normed, nxt.qkv), ["T", nxt.qkv.n]),
                      "res_out": (res, ["T", h])})


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
