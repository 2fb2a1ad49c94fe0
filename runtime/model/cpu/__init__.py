"""CPU fast path: GGUF weights kept in their quantized blocks and multiplied by ONNX Runtime's
``MatMulNBits`` kernels (``docs/cpu_fast_path.md``); the exact fp32 reference path stays in
``runtime.model.stage``."""

#: The last stage's extra work (final norm, 8-bit LM head, sampling) on the fast path, in decoder
#: layers: the quantized LM head runs 2.5-5x faster than fp32 while a layer's GEMMs gain ~2x and
#: its attention nothing, so it weighs ~0-3.5 layers (measured, 2-core machine, 1 and 4 decode
#: rows) rather than the ~7 of the MAC model; PP=2 then splits 17 / 13 instead of 19 / 11.
HEAD_COST_LAYERS = 3.0
