"""A linear layer over GGUF blocks run by ONNX Runtime's ``MatMulNBits`` (com.microsoft contrib
op; CPU kernels from MLAS): ``y [T, N] = x [T, K] @ w.T`` with ``w`` never dequantized in memory.

Each weight is one tiny ONNX graph (one node) in its own session (``sessions.init_threads`` sets
their threads); the stage itself uses the fused graphs of :mod:`runtime.model.cpu.segments`, this
module serves the kernel benchmark (``python -m runtime.bench cpu-kernels``). ``accuracy_level`` picks the compute type: 4 quantizes the
activations to int8 per block (fastest; integer dot products), 1 computes in fp32 (weights
dequantized block by block on the fly). Inputs and outputs are torch tensors sharing memory with
the numpy arrays ONNX Runtime reads / returns (no copy).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from runtime.model.cpu.gguf_blocks import BLOCK, BlockWeight
from runtime.model.cpu.sessions import open_session

def _graph(w: BlockWeight, accuracy_level: int) -> bytes:
    """The one-node ONNX model ``Y = MatMulNBits(X, B, scales[, zero_points])``, serialized."""
    inits = [numpy_helper.from_array(w.packed, "B"), numpy_helper.from_array(w.scales, "scales")]
    inputs = ["X", "B", "scales"]
    if w.zero_points is not None:
        inits.append(numpy_helper.from_array(w.zero_points, "zero_points"))
        inputs.append("zero_points")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=w.k, N=w.n,
                            bits=w.bits, block_size=BLOCK, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "qlinear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", w.k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", w.n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def _session(w: BlockWeight, accuracy_level: int) -> ort.InferenceSession:
    return open_session(_graph(w, accuracy_level))


class QuantLinear:
    """``y = x @ w.T`` over a :class:`BlockWeight` (see module doc).

    Args:
        w: the weight ``[N, K]`` in GGUF blocks.
        accuracy_level: ``MatMulNBits`` compute type for steps of fewer than ``big_rows`` tokens
            (4: int8 activations).
        big_accuracy_level: compute type for steps of ``big_rows`` tokens or more (prefill
            chunks), or None to use ``accuracy_level`` always.
        big_rows: see above.
    Attributes:
        n, k: output / input features. nbytes: bytes of the quantized operands.
    """

    def __init__(self, w: BlockWeight, accuracy_level: int = 4, big_accuracy_level: int | None = None,
                 big_rows: int = 64) -> None:
        self.n, self.k = w.n, w.k
        self.nbytes = w.packed.nbytes + w.scales.nbytes + (
            0 if w.zero_points is None else w.zero_points.nbytes)
        self._small = _session(w, accuracy_level)
        self._big = (None if big_accuracy_level in (None, accuracy_level)
                     else _session(w, big_accuracy_level))
        self.big_rows = big_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` fp32 (made contiguous) -> ``[T, N]`` fp32."""
        sess = self._big if self._big is not None and x.shape[0] >= self.big_rows else self._small
        y = sess.run(None, {"X": np.ascontiguousarray(x.detach().numpy())})[0]
        return torch.from_numpy(y)
