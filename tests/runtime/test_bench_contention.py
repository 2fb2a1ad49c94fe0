"""``runtime.bench contention``'s arithmetic on given stage times: the overlapped / sync ceiling
and the step-cost fit (the measurement itself: tests/runtime/test_bench_smoke.py)."""

import pytest

from runtime.bench.contention import ceilings, fit_step_cost


def _dec(threads, rows, alone, both):
    return {"threads": threads, "kind": "decode", "rows": rows, "query_len": 1, "prefix": 32,
            "alone_s": alone, "both_s": both}


def test_ceiling_compares_stages_taking_turns_with_half_lanes_at_once():
    pts = [_dec(1, 8, [0.10, 0.08], [0.19, 0.15]), _dec(1, 16, [0.12, 0.10], [0.2, 0.2]),
           _dec(2, 8, [0.06, 0.05], [0.12, 0.11]), _dec(2, 16, [0.07, 0.06], [0.12, 0.1]),
           _dec(1, 3, [0.1, 0.1], [0.1, 0.1])]
    got = {(c["threads"], c["concurrency"]): c for c in ceilings(pts, 2)}
    assert sorted(got) == [(1, 16), (2, 16)]          # 8 and 3 rows: no half measured
    c = got[(1, 16)]
    # sync: 0.12 + 0.10 = 0.22 s per round; overlapped: 2 x max(0.19, 0.15) = 0.38 s
    assert c["sync_round_s"] == pytest.approx(0.22) and c["overlapped_round_s"] == pytest.approx(0.38)
    assert c["ceiling"] == pytest.approx(0.22 / 0.38)
    assert c["ceiling_without_contention"] == pytest.approx(0.22 / 0.20)
    assert got[(2, 16)]["ceiling"] == pytest.approx(0.13 / 0.24)


def test_fit_recovers_the_prefix_term_from_chunks_at_several_prefixes():
    base, per_row, per_tok, per_pair = 0.02, 0.0, 0.001, 2e-6
    pts = []
    for r in (1, 4, 16, 64):
        t = base + per_row * r + per_tok * r + per_pair * r * 32
        pts.append(_dec(1, r, [t, t], [1.5 * t, 1.5 * t]))
    for p in (0, 256, 512, 1024):
        t = base + per_tok * 64 + per_pair * 64 * (p + 31.5)
        pts.append({"threads": 1, "kind": "prefill", "rows": 1, "query_len": 64, "prefix": p,
                    "alone_s": [t, t]})
    pts.append(_dec(2, 4, [9.0, 9.0], [9.0, 9.0]))    # other thread count: not fitted
    got = fit_step_cost(pts, threads=1, context=32)
    assert got["base_s"] == pytest.approx(base) and got["per_token_s"] == pytest.approx(per_tok)
    assert got["per_prefix_token_s"] == pytest.approx(per_pair)
    assert got["concurrency"] == pytest.approx(1.5) and got["num_samples"] == 8
