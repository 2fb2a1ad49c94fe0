"""runtime.bench.metrics on synthetic timestamps: percentiles, TTFT / TPOT / ITL / E2E."""

import pytest

from runtime.bench.metrics import RequestRecord, percentile, stats, summarize


def test_percentile_interpolates_between_ranks():
    vals = [4.0, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5 and percentile(vals, 0) == 1.0 and percentile(vals, 100) == 4.0
    assert percentile(vals, 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        percentile(vals, 101)


def test_request_timings_from_chunk_arrivals():
    r = RequestRecord(sent_s=10.0, chunk_s=[10.5, 10.7, 11.0, 11.1], prompt_tokens=8, output_tokens=5)
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.1)
    assert r.itl_s == pytest.approx([0.2, 0.3, 0.1])
    assert r.tpot_s == pytest.approx(0.6 / 4)     # one chunk carried 2 tokens: TPOT per token
    assert RequestRecord(0.0, [1.0], output_tokens=1).tpot_s is None


def test_summarize_counts_throughput_and_statistics():
    recs = [RequestRecord(0.0, [1.0, 2.0, 3.0], 10, 3),
            RequestRecord(1.0, [1.5, 2.0], 20, 2),
            RequestRecord(2.0, [], 5, 0, ok=False, error="HTTP 500")]
    s = summarize(recs, wall_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 1.25
    assert s["total_token_throughput"] == pytest.approx(35 / 4)
    assert s["ttft_mean_ms"] == pytest.approx(750.0) and s["ttft_median_ms"] == pytest.approx(750.0)
    assert s["tpot_mean_ms"] == pytest.approx(750.0)     # (2.0/2 + 0.5/1) / 2
    assert s["itl_median_ms"] == pytest.approx(1000.0)   # gaps 1.0, 1.0, 0.5
    assert s["itl_p99_ms"] == pytest.approx(1000.0) and s["itl_mean_ms"] == pytest.approx(2500 / 3)
    assert s["e2e_p90_ms"] == pytest.approx(1000 + 0.9 * 2000)
    with pytest.raises(ValueError, match="wall_s"):
        summarize(recs, 0.0)


def test_stats_keys_and_empty_input():
    assert stats([], "itl") == {"itl_mean_ms": 0.0, "itl_median_ms": 0.0, "itl_p90_ms": 0.0,
                                "itl_p99_ms": 0.0}
