"""Model resolution and loading: the default GGUF (config, sha256, per-stage reads), HF folders
(the GGUF's weights exported; tiny random Llamas with rope scaling vs transformers), clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from reference import hf_model
from runtime.model import registry
from runtime.model.batch_meta import BatchMeta
from runtime.model.config import ModelConfig
from runtime.model.errors import (INSTALL_HINT, ModelError, ModelIntegrityError, ModelNotFoundError,
                                  PartitionError, UnsupportedModelError, WeightShapeError)
from runtime.model.gguf_loader import GGUFCheckpoint, unpermute_qk
from runtime.model.stage import load_model_config, load_stage
from runtime.model.tensor_names import EMBED, LM_HEAD, stage_tensor_names

IDS = [1, 504, 3575, 282, 4649, 314, 2, 198, 1780, 314]


def logits(stages, ids, start=0, slot=0):
    meta = BatchMeta.build([slot], [start], [len(ids)])
    out = stages[0](meta, input_ids=torch.tensor(ids))
    for st in stages[1:]:
        out = st(meta, hidden=out[0], residual=out[1])
    return out


def test_default_gguf_config():
    cfg = load_model_config("default")
    assert cfg == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=np.float32(1e-5).item(),
        rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)


def test_registry(tmp_path, monkeypatch):
    path = registry.resolve_model_path("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and registry.is_gguf(path)
    assert registry.resolve_model_path(path) == path and registry.resolve_model_path(path.parent) == path
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        registry.resolve_model_path(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="not a model folder"):
        registry.resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        registry.resolve_model_path(tmp_path)
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as err:
        registry.resolve_model_path("default")
    assert INSTALL_HINT in str(err.value)


def test_sha256_verification(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"abc")
    with pytest.raises(ModelIntegrityError, match="differs from the pinned"):
        registry.verify_sha256(f, "0" * 64)
    registry.verify_sha256(f, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        permuted = w.reshape(n_head, 2, 12 // n_head // 2, 5).swapaxes(1, 2).reshape(12, 5)
        assert np.array_equal(unpermute_qk(permuted, n_head), w)


def test_stage_reads_only_its_tensors(monkeypatch, model_weights, make_stages):
    cfg, weights = model_weights
    read: list[str] = []
    orig = GGUFCheckpoint.read
    monkeypatch.setattr(GGUFCheckpoint, "read", lambda self, n: read.append(n) or orig(self, n))
    last = load_stage("default", (28, 30), max_num_reqs=2, max_model_len=32, progress=False)
    assert read == stage_tensor_names(cfg, (28, 30)) and EMBED in read and len(read) == 2 * 9 + 2
    assert (last.is_first, last.is_last, last.layer_start, last.layer_end) == (False, True, 28, 30)
    assert last.kv_cache.shape == (2, 2, 4, 16, 3, 64)
    assert torch.equal(last.lm_head, weights[EMBED])
    front = make_stages([(0, 28)], max_num_reqs=2, max_model_len=32)[0]
    whole = make_stages([(0, 30)], max_num_reqs=2, max_model_len=32)[0]
    assert torch.equal(logits([front, last], IDS), logits([whole], IDS))


def test_hf_folder_of_the_gguf_weights(tmp_path, model_weights, make_stages):
    cfg, weights = model_weights
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    model, tok = hf_model()
    tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and registry.resolve_model_path(tmp_path) == tmp_path
    assert load_model_config(tmp_path) == cfg.model_copy(update={"architecture": "LlamaForCausalLM"})
    hf_stage = load_stage(tmp_path, (0, 30), max_num_reqs=2, max_model_len=32, progress=False)
    ours = logits([hf_stage], IDS)
    assert torch.equal(ours, logits(make_stages([(0, 30)], max_num_reqs=2, max_model_len=32), IDS))
    # transformers reads the exported folder like the GGUF: names, Q/K order and config agree
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0, -1]
        torch.testing.assert_close(exported(torch.tensor([IDS])).logits[0, -1], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[0], ref, atol=1e-4, rtol=0)


ROPES = [None, {"rope_type": "linear", "factor": 4.0},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}]


def tiny_llama(tmp_path, rope, tie=False):
    """A random 2-layer GQA Llama saved by transformers; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    params = {"rope_theta": 500000.0, **(rope or {"rope_type": "default"})}
    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters=params, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(str(tmp_path))
    return model


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tiny_hf_llama_matches_transformers(tmp_path, rope, tie):
    model = tiny_llama(tmp_path, rope, tie)
    cfg = load_model_config(tmp_path)
    assert (cfg.rope_scaling or None) == (rope or None) and cfg.tie_word_embeddings == tie
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    kw = dict(max_num_reqs=3, max_model_len=60, progress=False)
    stages = [load_stage(tmp_path, r, **kw) for r in ((0, 1), (1, 2))]
    got = torch.cat([logits(stages, ids[:30], 0, 2), logits(stages, ids[30:], 30, 2)])
    torch.testing.assert_close(got, ref[[29, 49]], atol=1e-5, rtol=0)


def test_load_errors(tmp_path):
    tiny_llama(tmp_path, None)
    with pytest.raises(PartitionError, match="invalid for 2 layers"):
        load_stage(tmp_path, (1, 3), max_num_reqs=1, max_model_len=16, progress=False)
    from safetensors.torch import load_file
    kw = dict(max_num_reqs=1, max_model_len=16, progress=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors[LM_HEAD]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="'lm_head.weight' is missing"):
        load_stage(tmp_path, (1, 2), **kw)
    assert load_stage(tmp_path, (0, 1), **kw).is_first  # the first stage needs no LM head
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(81, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightShapeError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(81, 64\)"):
        load_stage(tmp_path, (0, 1), **kw)


def test_unsupported_configs(tmp_path):
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96,
            "intermediate_size": 80}
    (tmp_path / "config.json").write_text(json.dumps({**base, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel' is not supported"):
        load_model_config(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_scaling": {"type": "dynamic"}})
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2'"):
        ModelConfig.from_gguf_fields({"general.architecture": "gpt2"})
    legacy = ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"],
                                         "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling == {"type": "linear", "factor": 2.0} and legacy.head_dim == 16
