"""EngineCounters: active spans, busy seconds and the bubble fraction, on a controlled clock."""

import pytest

from runtime.engine import counters as mod
from runtime.engine.counters import EngineCounters


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    return now


def test_active_spans_and_bubble(clock):
    c = EngineCounters(pp_size=2)
    assert c.snapshot()["bubble_fraction"] == 0.0 and c.active_seconds() == 0.0
    c.step_issued()
    clock[0] += 4.0
    c.step_issued()                 # a span already open: no restart
    clock[0] += 6.0
    c.pipeline_idle()               # span [100, 110]
    clock[0] += 50.0                # idle time is not active time
    c.pipeline_idle()               # nothing open: no-op
    c.step_issued()
    clock[0] += 10.0                # open span [160, 170]
    c.busy_s[0] += 15.0
    c.busy_s[1] += 5.0
    c.steps_total, c.tokens_total = 3, 48
    s = c.snapshot()
    assert s["active_seconds"] == 20.0
    assert s["bubble_fraction"] == pytest.approx(1 - 20.0 / (2 * 20.0))
    assert (s["steps_total"], s["generated_tokens_total"], s["rank_busy_seconds"], s["pp_size"]) \
        == (3, 48, [15.0, 5.0], 2)


def test_bubble_never_negative(clock):
    c = EngineCounters(pp_size=1)
    c.step_issued()
    clock[0] += 1.0
    c.busy_s[0] = 3.0               # busy measured over a longer window than the span
    assert c.snapshot()["bubble_fraction"] == 0.0
