"""Trace format: every event model round-trips through JSON (hypothesis), the writer's flat lines
parse into the models, the SchedulerOutput codec round-trips, run directories never mix."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppstate.batch import FreedSlot, NewRequest, SchedulerOutput
from ppstate.events import JsonlSink, read_jsonl
from ppstate.codec import decode_output, encode_output
from ppstate.trace.models import EVENT_MODELS, TokenUpdateModel, parse_event
from ppstate.trace.run import TraceError, find_run_dir, new_run_dir

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                         max_size=3), max_leaves=8)


def _strategy(hint: Any) -> st.SearchStrategy:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return st.integers(-2**62, 2**62)
    if hint is str:
        return st.text(max_size=12)
    if hint is bool:
        return st.booleans()
    if hint is type(None):
        return st.none()
    if hint is Any:
        return _json
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in args))
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), _strategy(args[1]), max_size=3)
    if hint is TokenUpdateModel:
        return _model(hint)
    raise AssertionError(f"no strategy for {hint!r}")


def _model(cls) -> st.SearchStrategy:
    return st.builds(cls, **{n: _strategy(f.annotation) for n, f in cls.model_fields.items()})


@pytest.mark.parametrize("cls", EVENT_MODELS, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_event_model_round_trip(cls, data):
    ev = data.draw(_model(cls))
    line = ev.model_dump_json()
    back = parse_event(json.loads(line))
    assert type(back) is cls and back == ev


def test_writer_lines_parse_into_models(tmp_path):
    sink = JsonlSink(tmp_path / "r.jsonl")
    sink.emit("pp.consume", step=3, rank=0, idx_mapping=[2, -1, 0])
    sink.emit("timing", step=3, rank=1, phase="forward", t0_ns=10, t1_ns=25)
    sink.close()
    evs = [parse_event(d) for d in read_jsonl(tmp_path / "r.jsonl")]
    assert [type(e).__name__ for e in evs] == ["PPConsumeEvent", "TimingEvent"]
    assert evs[0].idx_mapping == [2, -1, 0] and evs[1].t1_ns - evs[1].t0_ns == 15
    with pytest.raises(FileExistsError):  # a run never appends to an existing file
        JsonlSink(tmp_path / "r.jsonl")


def test_truncated_last_line_is_dropped(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"kind":"rank.step","step":0,"rank":0,"num_rows":1}\n{"kind":"rank.st')
    assert read_jsonl(p) == [{"kind": "rank.step", "step": 0, "rank": 0, "num_rows": 1}]


def test_codec_round_trip_and_prompt_privacy():
    out = SchedulerOutput(
        7, ("a", "b"), np.array([3, 0], np.int32), np.array([4, 1], np.int32),
        np.array([0, 9], np.int32), np.array([False, True]),
        (NewRequest("a", 3, (11, 12, 13, 14), 20, {"temperature": 0.0}),),
        (FreedSlot("z", 5, "finished_aborted"),))
    enc = encode_output(out)
    new = enc["new_requests"][0]
    assert new["prompt_len"] == 4 and "prompt_token_ids" not in new
    back = decode_output(json.loads(json.dumps(enc)))
    assert back.new_requests[0].prompt_token_ids == (0, 0, 0, 0)
    assert encode_output(back) == enc
    full = encode_output(out, prompts=True)
    assert full["new_requests"][0]["prompt_token_ids"] == [11, 12, 13, 14]
    assert encode_output(decode_output(full), prompts=True) == full
    assert back.is_final_chunk.dtype == bool and back.slots.tolist() == [3, 0]


def test_run_dirs_are_fresh(tmp_path):
    a, b = new_run_dir(tmp_path), new_run_dir(tmp_path)
    assert a != b and not any(a.iterdir())
    with pytest.raises(TraceError):
        find_run_dir(tmp_path)  # no header yet


def test_bubble_fraction_counts_active_time_only():
    from ppstate.replay.timeline import Slice, bubble_fraction
    sl = [Slice(0, 0, "forward", 0, 10), Slice(1, 0, "recv", 0, 10), Slice(1, 0, "forward", 10, 20),
          Slice(0, 1, "forward", 1000, 1010), Slice(1, 1, "forward", 1010, 1020)]
    # active: [0, 20] and [1000, 1020] = 40 ns; compute 40 ns over 2 ranks -> half idle
    assert bubble_fraction(sl, 2) == 0.5
