"""The CPU path a rank serves with and the line rank 0 prints (runtime/model/cpu/path_choice.py);
the line itself is checked on real servers in tests/server/test_server_e2e.py (fast) and
tests/server/test_server_api_surface.py (exact)."""

from __future__ import annotations

import pytest

from runtime.model.cpu.path_choice import FAST, cpu_path_line, exact_reasons


def _never() -> str | None:
    raise AssertionError("the model is only opened when no flag bypasses the fast path")


@pytest.mark.parametrize("cpu_path,tp,k,want", [
    ("exact", 1, 0, "CPU path: exact (fp32 torch reference; reason: --cpu-path exact)"),
    ("fast", 2, 0, "CPU path: exact (fp32 torch reference; reason: --tp 2)"),
    ("fast", 1, 2, "CPU path: exact (fp32 torch reference; reason: --spec-tokens 2)"),
    ("exact", 3, 4, "CPU path: exact (fp32 torch reference; reason: --cpu-path exact, --tp 3, "
                    "--spec-tokens 4)"),
])
def test_flags_that_bypass_the_fast_path_are_named(cpu_path, tp, k, want):
    assert cpu_path_line(exact_reasons(cpu_path, tp, k, _never)) == want


def test_an_unsupported_model_is_named_and_a_llama_serves_fast():
    qwen = exact_reasons("fast", 1, 0, lambda: "family 'qwen2' with qkv bias")
    assert cpu_path_line(qwen) == ("CPU path: exact (fp32 torch reference; reason: family 'qwen2' "
                                   "with qkv bias is not implemented by the fast path)")
    assert exact_reasons("fast", 1, 0, lambda: None) == []
    assert cpu_path_line([]) == FAST == ("CPU path: fast (ONNX Runtime MatMulNBits: 8-bit weight "
                                         "blocks, int8 activations)")
