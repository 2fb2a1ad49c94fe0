"""JsonlSink: compact JSON lines, and events held behind a deferred one keep the emit order."""

from __future__ import annotations

import json

import pytest

from ppstate.events import JsonlSink, RecordingSink, read_jsonl


def test_lines_are_compact_json_with_kind_step_rank_first(tmp_path):
    sink = JsonlSink(tmp_path / "e.jsonl")
    sink.emit("schedule", step=3, rank=None, output={"req_ids": ("a", "b"), "n": [1, 2]})
    sink.emit("mirror.check", step=3, rank=1, slots=[0, 5], ok=True, message="é")
    sink.close()
    raw = (tmp_path / "e.jsonl").read_bytes().splitlines()
    assert raw[0] == b'{"kind":"schedule","step":3,"rank":null,"output":{"req_ids":["a","b"],"n":[1,2]}}'
    assert json.loads(raw[1]) == {"kind": "mirror.check", "step": 3, "rank": 1, "slots": [0, 5],
                                  "ok": True, "message": "é"}


def test_deferred_event_holds_later_ones_until_ready(tmp_path):
    path = tmp_path / "rank1.jsonl"
    sink = JsonlSink(path)
    ready, calls = [False], []

    def fields():
        calls.append(ready[0])
        return {"token_ids": [7, 8]}

    sink.emit("rank.step", step=0, rank=1, num_rows=2)
    sink.emit_when(lambda: ready[0], "sampled", 0, 1, fields)
    sink.emit("mirror.check", step=0, rank=1, slots=[0, 1])
    sink.emit("rank.step", step=1, rank=1, num_rows=2)
    sink._fh.flush()
    assert [e["kind"] for e in read_jsonl(path)] == ["rank.step"] and calls == []
    ready[0] = True
    sink.emit("rank.step", step=2, rank=1, num_rows=0)   # finds the held event ready
    sink._fh.flush()
    events = read_jsonl(path)
    assert [(e["kind"], e["step"]) for e in events] == [
        ("rank.step", 0), ("sampled", 0), ("mirror.check", 0), ("rank.step", 1), ("rank.step", 2)]
    assert events[1]["token_ids"] == [7, 8] and calls == [True]
    # close waits for a held event whose copy lands meanwhile (ready on the third poll) ...
    polls = iter([False, False, True])
    sink.emit_when(lambda: next(polls), "sampled", 2, 1, lambda: {"token_ids": [9]})
    sink.emit("timing", step=2, rank=1)
    sink.close()
    events = read_jsonl(path)
    assert [e["kind"] for e in events][-2:] == ["sampled", "timing"]
    assert events[-2]["token_ids"] == [9]


def test_close_drops_what_a_stuck_device_never_completes(tmp_path, monkeypatch):
    # ... and gives up on one that never lands (a device stuck behind a hung collective): the
    # trace then ends with the last event before it, instead of close hanging
    monkeypatch.setattr(JsonlSink, "HOLD_TIMEOUT_S", 0.05)
    path = tmp_path / "rank0.jsonl"
    sink = JsonlSink(path)
    sink.emit("rank.step", step=7, rank=0, num_rows=1)
    sink.emit_when(lambda: False, "sampled", 7, 0, lambda: pytest.fail("fields of a stuck copy"))
    sink.emit("timing", step=7, rank=0)
    sink.close()
    assert [(e["kind"], e["step"]) for e in read_jsonl(path)] == [("rank.step", 7)]


def test_in_memory_sinks_record_a_deferred_event_at_once():
    sink = RecordingSink()
    sink.emit_when(lambda: False, "sampled", 4, 0, lambda: {"token_ids": [1]})
    assert sink.events == [{"kind": "sampled", "step": 4, "rank": 0, "token_ids": [1]}]
