"""CPU fast path: GGUF weights kept in their quantized blocks and multiplied by ONNX Runtime's
``MatMulNBits`` kernels (``docs/cpu_fast_path.md``); the exact fp32 reference path stays in
``runtime.model.stage``."""
