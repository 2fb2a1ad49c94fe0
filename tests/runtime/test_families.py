"""Model families on the CPU reference path: Qwen2 (QKV bias), Qwen3 (q/k norm, yarn), Qwen3-MoE
and Mixtral (8 experts, 2 per token), each a tiny random folder saved by transformers' own classes.

* every family, stage by stage (in process): logits of the model cut at PP = 1, 2, 3 with chunked
  prefill equal transformers' forward;
* every family through the real engine (worker processes): greedy ids equal transformers'
  ``generate``. One engine per family, each a different pipeline configuration (the stage
  boundary carries the same (hidden, residual) pair whatever the family, so the cut itself is
  covered for every family by the stage test above): Qwen2 PP=2 overlapped with a prefix-cache
  hit, Qwen3 PP=1, Qwen3-MoE PP=3 sync with a KV budget that preempts, Mixtral PP=2 overlapped;
  all with prefill chunks of 8 tokens;
* GGUF files written from the folders with gguf-py (qwen2, qwen3, qwen3moe) equal the folders;
* every refused config field gets its message.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine_harness import EngineThread
from families import build_family_model, generate_reference, write_gguf
from runtime.config import EngineConfig
from runtime.model.batch_meta import BatchMeta
from runtime.model.config import ModelConfig
from runtime.model.errors import UnsupportedModelError
from runtime.model.stage import load_model_config, load_stage
from runtime.sampling_params import SamplingParams

FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "mixtral"]
NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
_RNG = random.Random(29)
PROMPTS = [[_RNG.randrange(2, 512) for _ in range(n)] for n in (7, 23, 40)]
LATE = PROMPTS[2][:32] + [301, 302, 303]  # after PROMPTS: its first 2 blocks are cached
ENGINES = {
    "qwen2": dict(pp_size=2, mode="overlapped"),
    "qwen3": dict(pp_size=1),
    "qwen3_moe": dict(pp_size=3, mode="sync", kv_cache_memory="20KB"),
    "mixtral": dict(pp_size=2, mode="overlapped"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (folder, transformers model, reference ids of PROMPTS + [LATE])."""
    out = {}
    for fam in FAMILIES:
        folder = tmp_path_factory.mktemp(fam)
        model = build_family_model(fam, folder)
        out[fam] = (folder, model, generate_reference(model, PROMPTS + [LATE], NEW))
    return out


def stage_logits(stages, ids, chunk: int):
    """Last-token logits after feeding ``ids`` in chunks of ``chunk`` through ``stages`` (slot 1)."""
    out = None
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        meta = BatchMeta.build([1], [start], [len(part)])
        out = stages[0](meta, input_ids=torch.tensor(part))
        for st in stages[1:]:
            out = st(meta, hidden=out[0], residual=out[1])
    return out[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_at_pp_1_2_3_match_transformers(family, built):
    folder, model, _ = built[family]
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    kw = dict(max_num_reqs=2, max_model_len=64, progress=False)
    for ranges, chunk in (([(0, 3)], 40), ([(0, 2), (2, 3)], 16), ([(0, 1), (1, 2), (2, 3)], 7)):
        got = stage_logits([load_stage(folder, r, **kw) for r in ranges], ids, chunk)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_family_configs_read_their_pieces(built):
    got = {f: load_model_config(built[f][0]) for f in FAMILIES}
    assert [(c.family, c.qkv_bias, c.qk_norm, c.num_experts, c.experts_per_token, c.moe_renormalize)
            for c in got.values()] == [("qwen2", True, False, 0, 0, False),
                                       ("qwen3", False, True, 0, 0, False),
                                       ("qwen3_moe", False, True, 8, 2, True),
                                       ("mixtral", False, False, 8, 2, True)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_transformers_generate(family, built):
    folder, _, ref = built[family]
    eng = EngineThread(EngineConfig(model=str(folder), max_num_seqs=4, max_model_len=64,
                                    max_prefill_chunk=8, max_num_batched_tokens=32,
                                    step_timeout_s=60.0, **ENGINES[family]))
    try:
        first = eng.generate(PROMPTS, GREEDY, prefix="a")
        late = eng.generate([LATE], GREEDY, prefix="b")
        stats = eng.engine.stats()
    finally:
        eng.close()
    assert [tuple(r["token_ids"]) for r in first + late] == ref
    assert stats["prefix_cache_hit_tokens"] >= 32
    if family == "qwen3_moe":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("family,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                         ("qwen3_moe", "qwen3moe")])
def test_gguf_from_the_folder_equals_the_folder(family, arch, built, tmp_path):
    folder = built[family][0]
    path = tmp_path / f"{family}.gguf"
    write_gguf(folder, path, arch)
    hf_cfg, gguf_cfg = load_model_config(folder), load_model_config(path)
    skip = {"architecture", "bos_token_id", "eos_token_id", "rms_norm_eps"}  # eps: stored as f32
    assert gguf_cfg.model_dump(exclude=skip) == hf_cfg.model_dump(exclude=skip)
    kw = dict(max_num_reqs=2, max_model_len=64, progress=False)
    ours = stage_logits([load_stage(path, (0, 2), **kw), load_stage(path, (2, 3), **kw)], PROMPTS[1], 8)
    theirs = stage_logits([load_stage(folder, (0, 3), **kw)], PROMPTS[1], 8)
    assert torch.equal(ours, theirs)


def test_yarn_rope_matches_transformers(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0}
    model = build_family_model("qwen3", tmp_path, layers=2, rope_parameters=yarn)
    assert load_model_config(tmp_path).rope_scaling["rope_type"] == "yarn"
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    got = stage_logits([load_stage(tmp_path, (0, 2), max_num_reqs=2, max_model_len=64,
                                   progress=False)], ids, 40)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96,
        "intermediate_size": 80}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3_MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
REFUSED = [
    ({**BASE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
     r"config field 'architectures': 'Qwen2MoeForCausalLM' is not supported \(supported: \["),
    ({**QWEN2, "use_sliding_window": True},
     r"config field 'use_sliding_window' = True is not supported for the qwen2 family "
     r"\(supported values: \[False, None\]\)"),
    ({**QWEN2, "layer_types": ["full_attention", "sliding_attention"]},
     r"config field 'layer_types' has \['sliding_attention'\] layers"),
    ({**QWEN2, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"config field 'rope_scaling.rope_type': 'dynamic' is not supported "
     r"\(supported: \['default', 'linear', 'llama3', 'yarn'\]\)"),
    ({**QWEN2, "hidden_act": "gelu"},
     r"config field 'hidden_act' = 'gelu' is not supported for the qwen2 family"),
    ({**QWEN3_MOE, "shared_expert_intermediate_size": 64},
     r"config field 'shared_expert_intermediate_size' = 64 is not supported for the qwen3_moe family"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9},
     r"config field 'num_experts_per_tok': 9 must be in \[1, 8\]"),
    ({**BASE, "model_type": "llama", "mlp_bias": True},
     r"config field 'mlp_bias' = True is not supported for the llama family"),
]


@pytest.mark.parametrize("cfg,message", REFUSED, ids=["arch", "sliding", "layer_types", "rope",
                                                      "act", "shared_experts", "top_k", "mlp_bias"])
def test_refused_config_fields_name_the_field(cfg, message, tmp_path):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_refused_gguf_fields():
    fields = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64,
              "qwen3moe.attention.head_count": 4, "qwen3moe.block_count": 2,
              "qwen3moe.vocab_size": 96, "qwen3moe.expert_count": 8,
              "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    assert ModelConfig.from_gguf_fields(fields).moe_renormalize  # llama.cpp's qwen3moe renormalises
    with pytest.raises(UnsupportedModelError, match=r"'qwen3moe.expert_shared_count': shared experts"):
        ModelConfig.from_gguf_fields({**fields, "qwen3moe.expert_shared_count": 1})
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'gpt2' is not supported "
                                                    r"\(supported: \['llama', 'qwen2', 'qwen3', 'qwen3moe'\]\)"):
        ModelConfig.from_gguf_fields({"general.architecture": "gpt2"})


def test_mistral_sliding_window_caps_the_context():
    cfg = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"],
                                      "sliding_window": 32, "max_position_embeddings": 4096})
    assert cfg.max_position_embeddings == 32
    json.dumps(cfg.model_dump())


# A ChatML template of the Qwen kind: system / user / assistant turns between <|im_start|> and
# <|im_end|>, earlier assistant turns without their <think> reasoning, and, with enable_thinking
# false, an empty think block opened and closed after the generation prompt.
CHATML_THINKING = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content"
    " + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set text = m.content %}"
    "{%- if '</think>' in text %}{%- set text = text.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + text + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_chatml_template_with_and_without_thinking_renders_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    from families import save_tiny_tokenizer
    from runtime.model.tokenizer import load_tokenizer
    folder = tmp_path
    save_tiny_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "t1", "chat_template": CHATML_THINKING}))
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "t5 t6"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nt7"},
            {"role": "user", "content": "t8 ünï"}]
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(msgs, add_generation_prompt=True, **kw) == want
    assert want.endswith("<|im_start|>assistant\n") and "hmm" not in want
    assert ours.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_sharded_folder_stage_reads_only_its_tensors(built, tmp_path, monkeypatch):
    from runtime.model.hf_loader import INDEX_FILE, HFCheckpoint
    _, model, _ = built["mixtral"]
    model.save_pretrained(str(tmp_path), max_shard_size="200KB")
    assert (tmp_path / INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 3
    read: list[str] = []
    orig = HFCheckpoint._read_disk
    monkeypatch.setattr(HFCheckpoint, "_read_disk", lambda self, n: read.append(n) or orig(self, n))
    kw = dict(max_num_reqs=2, max_model_len=64, progress=False)
    middle = load_stage(tmp_path, (1, 2), **kw)
    assert read and all(n.startswith("model.layers.1.") for n in read)
    assert len(read) == 6 + 1 + 3 * 8                  # attention + norms, router, 8 experts x 3
    last = load_stage(tmp_path, (2, 3), **kw)
    first = load_stage(tmp_path, (0, 1), **kw)
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(stage_logits([first, middle, last], ids, 8), ref, atol=2e-5, rtol=0)


def test_qwen2_gguf_pre_tokenizer_splits_single_digits():
    from tokenizers import Regex, pre_tokenizers

    from runtime.model.gguf_vocab import PRE_TOKENIZER_SPLITS
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"][0]), behavior="isolated")
    assert [t for t, _ in split.pre_tokenize_str("I've 12345 apples!\n\nok")] == \
        ["I", "'ve", " ", "1", "2", "3", "4", "5", " apples", "!\n\n", "ok"]


def test_qwen3_moe_dense_layers_and_sparse_step_match_transformers(tmp_path):
    model = build_family_model("qwen3_moe", tmp_path, layers=3, mlp_only_layers=[0],
                               decoder_sparse_step=1)
    cfg = load_model_config(tmp_path)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    kw = dict(max_num_reqs=2, max_model_len=64, progress=False)
    got = stage_logits([load_stage(tmp_path, (0, 1), **kw), load_stage(tmp_path, (1, 3), **kw)], ids, 8)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
