"""Pin down a pipeline-parallel configuration in your own test suite with ppstate's pytest plugin.

Runs as is, alone in an empty folder: ``pip install 'ppstate[test]'`` (the plugin registers
itself through the ``pytest11`` entry point), then ``pytest test_with_ppstate.py``. Each test
starts the real default model (SmolLM2-135M-Instruct, embedded) cut into 2 pipeline stages, i.e.
two worker processes over gloo, and stops them when the test ends, passed or failed.
Add ``--ppstate-trace-dir traces/`` to keep every run's trace; a failing test prints its path.
"""

import pytest

from ppstate.testing import assert_invariants, explain
from runtime.sampling_params import SamplingParams

# Greedy (argmax, fp32) continuations of the default model, computed independently with
# transformers loading the same GGUF file.
PARIS = "The capital of France is"
PARIS_GREEDY = [7042, 30, 198, 198, 504, 2988]
PIPELINE = ("Pipeline parallelism splits the layers of a language model into stages that run on "
            "different devices, so that")
PIPELINE_GREEDY = [260, 1142, 1789, 1743]


async def collect(engine, req_id, prompt_ids, params, abort_after=None):
    """Stream one request to its end; abort it once ``abort_after`` tokens arrived."""
    tokens, reason = [], None
    async for out in engine.add_request(req_id, prompt_ids, params):
        tokens += out.new_token_ids
        reason = out.finish_reason or reason
        if abort_after is not None and len(tokens) >= abort_after and not out.finished:
            await engine.abort(req_id)
    return tokens, reason


@pytest.mark.asyncio
async def test_abort_mid_decode_frees_the_slot(pp_engine):
    engine = await pp_engine(pp_size=2, max_num_seqs=1, max_model_len=64)
    ids = engine.tokenizer.encode(PARIS)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    tokens, reason = await collect(engine, "a", ids, greedy, abort_after=2)
    assert reason == "abort"
    assert 2 <= len(tokens) < 32 and tokens == PARIS_GREEDY[:len(tokens)]

    # max_num_seqs=1: the next request can only run if the abort gave its slot back.
    tokens, reason = await collect(engine, "b", ids, greedy.model_copy(update={"max_tokens": 6}))
    assert (tokens, reason) == (PARIS_GREEDY, "length")

    await engine.shutdown()   # closes the trace files; the fixture would do it anyway
    result = assert_invariants(engine)   # replays the recorded run, checks every invariant
    assert result.rank_steps[0] == result.rank_steps[1] == result.steps
    life = explain(engine.config.trace_dir, "a")
    assert [e["state"] for e in life if e["what"] == "lifecycle"][-1] == "finished_aborted"


@pytest.mark.asyncio
async def test_chunked_prefill_gives_the_unchunked_tokens(pp_engine):
    engine = await pp_engine(pp_size=2, max_prefill_chunk=8, max_model_len=64)
    ids = engine.tokenizer.encode(PIPELINE)
    assert len(ids) == 20

    tokens, reason = await collect(engine, "long", ids, SamplingParams(max_tokens=4, temperature=0))
    assert (tokens, reason) == (PIPELINE_GREEDY, "length")

    await engine.shutdown()
    assert_invariants(engine)
    prefill = [(e["start"], e["num_scheduled_tokens"], e["final_chunk"])
               for e in explain(engine.config.trace_dir, "long")
               if e["what"] == "scheduled" and e["start"] < len(ids)]
    assert prefill == [(0, 8, False), (8, 8, False), (16, 4, True)]
