"""`python -m runtime.generate` user errors: one line naming the flag, no traceback, no workers.

The CLI's ``main`` runs in the test process (a subprocess per case only added a Python + torch
start-up each); the real ``python -m runtime.generate`` entry point runs in test_torchrun.py. An
exception escaping ``main`` fails the test, as a traceback on stderr would have; a logged
traceback is caught through ``caplog``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.plan import check_resources
from runtime.generate import main
from runtime.model.stage import load_model_config


@pytest.fixture
def generate(capsys, caplog):
    """``generate(*flags)``: ``main(["--prompt", "Hello", *flags])`` as the CLI runs it, returning
    ``(returncode, stderr)`` (argparse errors exit with code 2, as from the shell)."""
    caplog.set_level(logging.DEBUG)

    def run(*args: str) -> SimpleNamespace:
        before = {c.pid for c in mp.active_children()}
        try:
            rc = main(["--prompt", "Hello", *args])
        except SystemExit as exc:
            rc = exc.code
        err = capsys.readouterr().err
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        assert not [c for c in mp.active_children() if c.pid not in before], "a worker started"
        return SimpleNamespace(returncode=rc, stderr=err)
    return run


@pytest.mark.parametrize("args, rc, expected", [
    (["--pp-layer-partition", "10,10"], 1,
     "error: --pp-layer-partition '10,10' sums to 20 layers; the model has 30"),
    (["--model", "/nonexistent"], 1, "error: model path /nonexistent does not exist"),
    (["--max-tokens", "0"], 2, "error: --max-tokens: Input should be greater than or equal to 1"),
    (["--max-tokens", "99999"], 2,
     "error: --max-tokens: prompt 0 has 1 tokens; with --max-tokens 99999 that exceeds "
     "--max-model-len 2048"),
    (["--tp", "2"], 1,   # the embedded SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536
     "error: --tp 2: the model has 9 attention heads and 3 KV heads; --tp must divide the 9 "
     "attention heads and divide the 3 KV heads or be a multiple of 3 (valid, with the MLP "
     "intermediate size 1536 split too: 1, 3)\n"),
    (["--max-model-len", "999999"], 1,
     "error: --max-model-len: 999999 exceeds the model's context length 8192"),
    (["--chat-template", "/nonexistent.jinja"], 2,   # was a FileNotFoundError traceback
     "error: --chat-template: '/nonexistent.jinja' is neither a built-in template (hermes) nor "
     "a file\n"),
])
def test_user_errors_are_one_line_naming_the_flag(generate, args, rc, expected):
    res = generate(*args)
    assert res.returncode == rc, res.stderr
    assert expected in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_any_worker_starts(generate):
    res = generate("--device", "cuda")
    assert res.returncode == 1
    assert "error: --device: cuda was asked for but torch sees no CUDA device" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_fused_mirror_check_kernel_on_a_cpu_engine_is_refused(generate):
    res = generate("--mirror-check-kernel", "fused")
    assert res.returncode == 1
    assert ("error: --mirror-check-kernel: fused applies to CUDA ranks only (inside their CUDA "
            "graph); this engine's ranks run on the CPU (--device auto), where it would have no "
            "effect") in res.stderr
    with pytest.raises(ValueError, match=r"^--mirror-check-kernel: fused .* \(--device cpu\)"):
        check_resources(EngineConfig(mirror_check_kernel="fused", device="cpu"),
                        load_model_config("default"))


def test_kv_cache_larger_than_memory_is_refused():
    cfg = load_model_config("default")
    with pytest.raises(ValueError, match=r"^--max-model-len / --max-num-seqs: KV caches of 4096 x "
                                         r"8192 tokens need 1440\.0 GiB"):
        check_resources(EngineConfig(max_num_seqs=4096, max_model_len=8192, device="cpu"), cfg)
    check_resources(EngineConfig(max_num_seqs=32, max_model_len=2048, device="cpu"), cfg)


def test_a_chat_template_that_does_not_compile_is_refused(generate, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    res = generate("--chat-template", str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.endswith(
        f"error: --chat-template: {bad}: chat template does not compile: Unexpected end of "
        "template. Jinja was looking for the following tags: 'endfor' or 'else'. The innermost "
        "block that needs to be closed is 'for'. (line 1)\n")


def test_chat_prompts_are_rendered_with_the_chat_template_flag(tmp_path):
    """--chat --chat-template FILE: the prompt is the template's rendering ('XX hi'), not the
    model's own template (which --chat used whatever --chat-template said)."""
    import argparse
    from runtime.config import EngineConfig
    from runtime.generate import tokenize_all
    from runtime.model.registry import default_model_path
    from runtime.model.tokenizer import load_tokenizer
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}XX {{ m.content }}{% endfor %}")
    config = EngineConfig(chat_template=str(tpl))
    ids = tokenize_all(argparse.ArgumentParser(), [[{"role": "user", "content": "hi"}]], config, 2)
    tok = load_tokenizer(default_model_path())
    assert ids == [tok.encode("XX hi")] == [[9832, 15876]]
