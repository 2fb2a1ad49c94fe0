"""Issue 32's OpenAI surface through the real server (``python -m runtime.serve``, PP=2) and the
``openai`` client: n / best_of, batched prompts, echo with prompt logprobs, max_tokens 0 scoring,
logit_bias, /tokenize and /detokenize, cached_tokens, chat_template_kwargs, the reasoning parser,
and 400s naming the field for bad values of each.

One server per module, on a random 2-layer Llama (hidden 64) written here (torch + safetensors)
with a word-level tokenizer (``t0`` .. ``t255``), started with ``--reasoning-parser deepseek_r1``;
transformers' model of the same folder, loaded while the server starts, is the reference for
prompt logprobs (fp32 log-softmax at each position).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from test_server_e2e import ServerProcess, metric_samples
from tiny_models import load_reference, reference_logprobs, write_tiny_llama

VOCAB = 256
MAX_MODEL_LEN = 64
IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


def prompt_of(*ids: int) -> str:
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path, VOCAB, MAX_MODEL_LEN)
    return str(path)


@pytest.fixture(scope="module")
def served(folder):
    proc = ServerProcess("--model", folder, "--pp", "2", "--cpu-path", "exact",
                         "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-seqs", "8", "--max-prefill-chunk", "16",
                         "--reasoning-parser", "deepseek_r1")
    try:
        load_reference(folder)   # transformers loads while the server starts
        proc.url = proc.wait_ready(180)
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def server(served) -> str:
    return served.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def ids_of(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def complete(client, prompt, **kw):
    extra = {**IDS, **kw.pop("extra_body", {})}
    return client.completions.create(model="default", prompt=prompt, logprobs=0,
                                     extra_body=extra, **kw)


def hits(url: str) -> float:
    return metric_samples(url)[("ppstate_prefix_cache_hits_total", ())]


def test_startup_names_the_exact_cpu_path_and_its_reason(served):
    log = Path(served.log.name).read_text()   # not through the shared handle: its offset is the server's
    lines = [x for x in log.splitlines() if x.startswith("CPU path: ")]
    assert lines == ["CPU path: exact (fp32 torch reference; reason: --cpu-path exact)"]


def test_n_with_seed_equals_separate_seeded_requests_and_shares_the_prefill(server, client):
    prompt = prompt_of(*range(10, 50))            # 40 tokens: 2 full blocks of 16 shareable
    before = hits(server)
    r = complete(client, prompt, n=4, seed=7, temperature=1.0, max_tokens=6)
    after = hits(server)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert after - before == 3 * 32               # each fork took the parent's full blocks
    got = [ids_of(c) for c in r.choices]
    for j in range(4):
        single = complete(client, prompt, seed=7 + j, temperature=1.0, max_tokens=6)
        assert ids_of(single.choices[0]) == got[j]
    assert len({tuple(g) for g in got}) > 1       # different seeds, different samples
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 24


def test_best_of_returns_the_highest_cumulative_logprob(client):
    prompt = prompt_of(60, 61, 62)
    best = complete(client, prompt, n=1, best_of=3, seed=3, temperature=1.0, max_tokens=5)
    totals = []
    for j in range(3):
        c = complete(client, prompt, seed=3 + j, temperature=1.0, max_tokens=5).choices[0]
        totals.append((sum(c.logprobs.token_logprobs), ids_of(c)))
    assert len(best.choices) == 1 and ids_of(best.choices[0]) == max(totals)[1]
    # usage counts every generated sample (3 x 5 tokens), not only the returned one
    assert (best.usage.prompt_tokens, best.usage.completion_tokens) == (3, 15)


def test_best_of_usage_counts_every_sample_of_every_prompt(client):
    """Two prompts (3 and 2 tokens), best_of 3, n 2, 4 tokens each (ignore_eos): 4 choices
    returned, 2 x 3 x 4 = 24 completion tokens generated and counted."""
    r = complete(client, [prompt_of(60, 61, 62), prompt_of(70, 71)], n=2, best_of=3, seed=5,
                 temperature=1.0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(len(ids_of(c)) == 4 for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 24, 29)


def test_a_batch_of_prompts_equals_single_requests(client):
    prompts = [prompt_of(20, 21, 22), prompt_of(30, 31), prompt_of(40, 41, 42, 43)]
    batch = complete(client, prompts, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, p in enumerate(prompts):
        single = ids_of(complete(client, p, temperature=0, max_tokens=5).choices[0])
        assert ids_of(batch.choices[2 * i]) == ids_of(batch.choices[2 * i + 1]) == single
    assert batch.usage.prompt_tokens == 9 and batch.usage.completion_tokens == 30
    stream = client.completions.create(model="default", prompt=prompts, n=2, temperature=0,
                                       max_tokens=5, logprobs=0, stream=True, extra_body=IDS)
    streamed: dict[int, list[int]] = {k: [] for k in range(6)}
    finished = set()
    for chunk in stream:
        for ch in chunk.choices:
            streamed[ch.index] += ids_of(ch) if ch.logprobs else []
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == set(range(6))
    assert [streamed[k] for k in range(6)] == [ids_of(c) for c in batch.choices]
    ids_batch = complete(client, [[20, 21, 22], [30, 31]], temperature=0, max_tokens=5)
    assert [ids_of(c) for c in ids_batch.choices] == [ids_of(batch.choices[0]), ids_of(batch.choices[2])]


def test_echo_with_prompt_logprobs_matches_transformers(folder, client):
    ids = [7, 9, 11, 200, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73]
    r = client.completions.create(model="default", prompt=prompt_of(*ids), echo=True, logprobs=2,
                                  max_tokens=3, temperature=0, n=2, extra_body=IDS)
    c = r.choices[0]
    assert r.choices[1].logprobs.token_logprobs == c.logprobs.token_logprobs
    assert c.text.startswith(prompt_of(*ids))
    assert ids_of(c)[:len(ids)] == ids and len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    ref = reference_logprobs(load_reference(folder), ids)
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(want, abs=2e-4)
    top = c.logprobs.top_logprobs[5]          # the prompt token plus the 2 most likely
    best2 = ref[4].topk(2).indices.tolist()
    assert {f"token_id:{t}" for t in best2} <= set(top) and f"token_id:{ids[5]}" in top


def test_max_tokens_0_with_echo_scores_the_prompt_only(folder, client):
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    r = client.completions.create(model="default", prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    c = r.choices[0]
    assert c.text == prompt_of(*ids) and c.finish_reason == "length"
    assert ids_of(c) == ids and r.usage.completion_tokens == 0
    ref = reference_logprobs(load_reference(folder), ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))], abs=2e-4)
    streamed = client.completions.create(model="default", prompt=ids, echo=True, logprobs=0,
                                         max_tokens=0, stream=True,
                                         extra_body={"return_tokens_as_token_ids": True})
    chunks = [ch.choices[0] for ch in streamed if ch.choices]
    assert "".join(ch.text for ch in chunks) == c.text
    assert [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs] == \
        c.logprobs.token_logprobs
    # vLLM's prompt_logprobs field
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "prompt_logprobs": 1}
    plp = httpx.post(f"{client.base_url}completions", json=body, timeout=60).json()
    entries = plp["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert entries[3][str(ids[3])]["logprob"] == pytest.approx(float(ref[2, ids[3]]), abs=2e-4)


def test_logit_bias_forces_and_forbids(client):
    prompt = prompt_of(90, 91, 92)
    forced = complete(client, prompt, temperature=0, max_tokens=4, logit_bias={"77": 100})
    assert ids_of(forced.choices[0]) == [77] * 4
    plain = ids_of(complete(client, prompt, temperature=0, max_tokens=1).choices[0])[0]
    banned = complete(client, prompt, temperature=0, max_tokens=1, logit_bias={str(plain): -100})
    assert ids_of(banned.choices[0])[0] != plain


def test_tokenize_round_trips_and_cached_tokens_report_the_prefix_hit(server, client):
    text = prompt_of(*range(100, 137))           # 37 tokens: 2 full blocks cached
    tok = httpx.post(f"{server}/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == list(range(100, 137)) and tok["count"] == 37
    assert tok["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(f"{server}/tokenize", json={
        "messages": [{"role": "user", "content": "t9"}], "chat_template_kwargs":
        {"enable_thinking": False}, "return_token_strs": True}).json()
    assert chat["tokens"] == [3, 9, 4, 5, 6] and chat["token_strs"] == ["t3", "t9", "t4", "t5", "t6"]
    first = client.completions.create(model="default", prompt=text, max_tokens=1)
    again = client.completions.create(model="default", prompt=text, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_n_template_kwargs_and_reasoning_content(client):
    msgs = [{"role": "user", "content": "t9 t10"}]
    r = client.chat.completions.create(model="default", messages=msgs, n=2, max_tokens=4,
                                       temperature=0, extra_body={
                                           "chat_template_kwargs": {"enable_thinking": False},
                                           "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    # deepseek_r1: a reply without </think> is all reasoning
    texts = [c.message.model_extra["reasoning_content"] for c in r.choices]
    assert texts[0] == texts[1] and len(texts[0].split()) == 4
    assert all(c.message.content is None for c in r.choices)
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="default", messages=msgs, n=2, max_tokens=4,
                                            temperature=0, stream=True, extra_body={
                                                "chat_template_kwargs": {"enable_thinking": False},
                                                "ignore_eos": True})
    parts: dict[int, str] = {0: "", 1: ""}
    for chunk in stream:
        for ch in chunk.choices:
            parts[ch.index] += ch.delta.model_extra.get("reasoning_content") or ""
    assert parts[0] == parts[1] == texts[0]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "t1", "n": 0}, "n"),
    ({"prompt": "t1", "n": 9}, "n"),
    ({"prompt": "t1", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "t1", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "t1", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "t1", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "t1", "logit_bias": {"9999": 1}}, "logit_bias.9999"),
    ({"prompt": "t1", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "t1", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": ["t1", [1]]}, "prompt"),
    ({"prompt": [[1], [9999]]}, "prompt[1]"),
])
def test_bad_values_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}],
                              "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}], "n": 9}, "n"),
    ("/tokenize", {"prompt": "t1", "messages": [{"role": "user", "content": "t1"}]}, "prompt"),
    ("/detokenize", {"tokens": [9999]}, "tokens"),
])
def test_bad_values_of_other_endpoints_are_400s(server, path, body, param):
    r = httpx.post(f"{server}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
