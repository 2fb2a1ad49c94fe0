"""The engine's per-step host path outside the scheduler (issue #13): logprobs as arrays from the
worker's sampler output to the engine's TokenLogprob entries, the streams' merged increments and
the tokenizer's single-token decode cache. No processes: each piece is driven directly."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from ppstate.batch import StepResult
from runtime import transport as tp
from runtime.engine.outputs import TokenLogprob, logprob_index, logprobs_for
from runtime.engine.request_stream import RequestStream
from runtime.model.registry import resolve_model_path
from runtime.model.tokenizer import load_tokenizer
from runtime.sampling.sampler import SamplerOutput
from runtime.sampling.step_logprobs import StepLogprobs
from runtime.sampling_params import SamplingParams
from runtime.worker.pending_result import LogprobRows


def _expected(lp, top_ids, top_vals, ks, rows_idx, num_rows):
    """The per-row entries the way the worker built them before (lists and dicts, row by row)."""
    outs = [None] * num_rows
    for j, k in enumerate(ks):
        if k >= 0:
            alts = {int(top_ids[j][t]): float(top_vals[j][t]) for t in range(k)}
            outs[int(rows_idx[j])] = (float(lp[j]), alts)
    return outs


@pytest.mark.parametrize("width", [0, 3])
def test_logprob_arrays_travel_and_equal_the_per_row_entries(width):
    g = torch.Generator().manual_seed(width)
    num_rows, rows_idx = 7, np.array([0, 2, 3, 5, 6])            # rows 1 and 4 do not sample
    ks = np.array([2, -1, 0, width, -1])[: len(rows_idx)]
    ks = np.minimum(ks, width)
    lp = -torch.rand(len(rows_idx), generator=g)
    top = None
    if width:
        vals, ids = torch.rand(len(rows_idx), width, generator=g).sort(dim=1, descending=True)
        top = (torch.randint(0, 1000, (len(rows_idx), width), generator=g), -vals)
    so = SamplerOutput(torch.zeros(len(rows_idx), dtype=torch.int64), lp, top)
    step_lps = LogprobRows.of(so, rows_idx, num_rows, ks).entries()
    assert isinstance(step_lps, StepLogprobs)
    assert step_lps.rows.tolist() == rows_idx[ks >= 0].tolist()
    res = StepResult(9, np.arange(num_rows, dtype=np.int64)[:, None] + 100,
                     np.ones(num_rows, np.int32), np.zeros(num_rows, np.int32), step_lps)
    back = tp.to_step_result(tp.decode(tp.encode(tp.from_step_result(res, rank=0))))
    req_ids = tuple(f"r{i}" for i in range(num_rows))
    index = logprob_index(back, req_ids)
    assert sorted(index) == [req_ids[r] for r in rows_idx[ks >= 0]]       # only those who asked
    want = _expected(lp.tolist(), top[0].tolist() if top else [[]] * 5,
                     top[1].tolist() if top else [[]] * 5, ks.tolist(), rows_idx, num_rows)
    for i, rid in enumerate(req_ids):
        got = logprobs_for(back, index, rid, [100 + i])
        if want[i] is None:
            assert got is None
        else:
            lp_i, alts = want[i]
            assert got == [TokenLogprob(100 + i, pytest.approx(lp_i), pytest.approx(alts))]
            assert list(got[0].top) == list(alts)                       # most likely first


def test_logprob_arrays_of_inconsistent_shapes_are_refused():
    z = np.zeros(2, np.int32)
    with pytest.raises(ValueError):
        StepLogprobs(z, np.zeros(2, np.float32), np.array([0, 3], np.int32),
                     np.zeros((2, 2), np.int64), np.zeros((2, 2), np.float32))
    msg = tp.LogprobArrays(*(tp.NdArray.of(a) for a in (z, np.zeros(3, np.float32), z,
                                                       np.zeros((2, 0), np.int64),
                                                       np.zeros((2, 0), np.float32))))
    with pytest.raises(tp.TransportError):
        msg.to_step_logprobs()


def test_unread_increments_merge_into_one_and_the_last_is_final():
    async def go():
        s = RequestStream("r", SamplingParams(max_tokens=8), 3, detok=None)
        lp = lambda t: [TokenLogprob(t, -0.5, {t: -0.5})]  # noqa: E731
        s._put(tp_out("r", [5], "a", False, None, 1, lp(5)))
        first = await s.get()                                # read: nothing to merge with
        s._put(tp_out("r", [6], "b", False, None, 2, lp(6)))
        s._put(tp_out("r", [7], "c", False, None, 3, lp(7)))   # unread: merged
        s.num_output_tokens = 3                              # as push_tokens counts
        s.finish("abort", error="gone", error_kind="engine")
        merged = await s.get()
        return first, merged, s.finished
    first, merged, finished = asyncio.run(go())
    assert (first.new_token_ids, first.new_text, first.finished) == ([5], "a", False)
    assert merged.new_token_ids == [6, 7] and merged.new_text == "bc"
    assert [e.token_id for e in merged.logprobs] == [6, 7]
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens) == (True, "abort", 3)
    assert (merged.error, merged.error_kind, finished) == ("gone", "engine", True)


def tp_out(req_id, ids, text, finished, reason, n, lps):
    from runtime.engine.outputs import RequestOutput
    return RequestOutput(req_id, ids, text, finished, reason, 3, n, lps)


def test_single_token_decode_cache_equals_decode():
    tok = load_tokenizer(resolve_model_path("default"))
    ids = tok.encode("Sure! 😀 你好 <|im_end|>") + [0, 1, 2]
    for skip in (False, True):
        for _ in range(2):                                   # second round: from the cache
            assert [tok.decode_token(i, skip) for i in ids] == \
                [tok.decode([i], skip_special_tokens=skip) for i in ids]


@pytest.mark.parametrize("transport", ["queue", "zmq"])
def test_engine_host_bench_delivers_every_token_over_both_transports(transport):
    from runtime.bench import engine_host
    from runtime.config import EngineConfig
    cfg = EngineConfig(model="default", pp_size=1, max_num_seqs=4, max_model_len=64,
                       max_num_batched_tokens=4096, max_prefill_chunk=4096)
    prompts = [[100 + i] * 8 for i in range(4)]
    r = asyncio.run(engine_host.run(cfg, prompts, 6, None, transport))
    # one prefill step gives each request its first token, five decode steps the rest; the two
    # slot-freeing steps (no rows: after the warm-up, after the last tokens) are counted when
    # their answers arrive inside the timed part (over sockets that depends on the io thread)
    assert (r["output_tokens"], r["transport"]) == (24, transport) and 6 <= r["steps"] <= 8


def test_stop_string_inside_an_accepted_draft_run_ends_the_ids_logprobs_and_count_there():
    """Speculative decoding delivers several tokens of a request in one step; a stop string that
    ends on the 8th of 10 must end the output there, as the spec-off engine (one token per step)
    does: the two tokens after it were in the increment's ids, logprobs and completion_tokens."""
    from runtime.model.detokenizer import IncrementalDetokenizer
    tok = load_tokenizer(resolve_model_path("default"))
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) == 10 and tok.decode(ids[7:8]) == " lazy"
    lps = [TokenLogprob(t, -0.5) for t in ids]

    def stream():
        return RequestStream("r", SamplingParams(max_tokens=32, stop=["lazy"]), 3,
                             detok=IncrementalDetokenizer(tok, [1, 2, 3], stop=["lazy"]))
    off = stream()                                            # one token per step
    reasons = [off.push_tokens([t], None, [lp]) for t, lp in zip(ids[:8], lps[:8])]
    on = stream()                                             # the whole run in one step
    assert on.push_tokens(list(ids), None, list(lps)) == "stop" == reasons[-1]
    a, b = on._pending, off._pending
    assert (a.new_text, a.new_token_ids, a.num_output_tokens, a.finish_reason) == \
        ("The quick brown fox jumps over the ", ids[:8], 8, "stop")
    assert [e.token_id for e in a.logprobs] == ids[:8]
    assert (a.new_text, a.new_token_ids, a.num_output_tokens) == \
        (b.new_text, b.new_token_ids, b.num_output_tokens)
    assert on.finished and on.num_output_tokens == 8


def test_accepted_run_without_a_stop_hit_is_pushed_whole():
    from runtime.model.detokenizer import IncrementalDetokenizer
    tok = load_tokenizer(resolve_model_path("default"))
    ids = tok.encode("The quick brown fox jumps")
    s = RequestStream("r", SamplingParams(max_tokens=32, stop=["zebra"]), 3,
                      detok=IncrementalDetokenizer(tok, [1, 2, 3], stop=["zebra"]))
    assert s.push_tokens(list(ids), None) is None
    out = s._pending
    assert (out.new_text, out.new_token_ids, out.num_output_tokens) == \
        ("The quick brown fox jumps", ids, len(ids))
