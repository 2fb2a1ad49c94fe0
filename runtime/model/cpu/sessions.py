"""ONNX Runtime sessions of the CPU fast path: how many threads each computes with and how it is
opened (the segments of a stage, the single GEMMs of the kernel benchmark)."""

from __future__ import annotations

import onnxruntime as ort

_threads = 1   # intra-op threads of each session opened from now on (init_threads)


def init_threads(threads: int) -> None:
    """Threads each ONNX Runtime session of this process computes with (sessions opened later).

    Every session gets its own pool of ``threads - 1`` helper threads that sleep between runs
    (spinning off): a rank's sessions run one at a time, and on a loaded or shared machine
    spinning helpers (or one process-wide spinning pool: 2 threads measured 15-30x slower than 1
    there) take the cores the other stage and the Python thread need.
    """
    global _threads
    _threads = max(1, int(threads))


def open_session(model: bytes) -> ort.InferenceSession:
    """A CPU session on a serialized ONNX model with :func:`init_threads` intra-op threads,
    spinning off, and no memory arena (a rank holds ~30 sessions; arenas kept each one's largest
    prefill activations, +480 MiB RSS after one 512-token chunk)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = _threads, 1
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = False
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
