"""Smoke runs of ``python -m runtime.bench serve | pp | sched`` with tiny sizes (figures are not
judged here: speed targets live in the benchmark results, never in tests)."""

import json

import numpy as np
import pytest

from runtime.bench import pp, sched, serve

pytestmark = pytest.mark.slow


def test_sched_control_plane_keeps_mirrors_equal_to_the_scheduler(tmp_path):
    out = tmp_path / "sched.json"
    assert sched.main(["--live", "4,8", "--steps", "6", "--repeats", "2", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "sched" and doc["command"].startswith("python -m runtime.bench sched")
    assert doc["date"] and doc["machine"]
    assert [r["live"] for r in doc["results"]["results"]] == [4, 8]
    assert all(r["us_per_step"] > 0 and len(r["all_us_per_step"]) == 2 for r in doc["results"]["results"])
    plane = sched.ControlPlane(6, 3, prompt_len=5, max_model_len=64)
    plane.warm_up()
    for _ in range(20):
        plane.step()
    live = [r.slot for r in plane.sched.running_requests()]
    assert len(live) == 6
    for m in plane.mirrors:  # every rank applied every issued step: same computed tokens
        np.testing.assert_array_equal(m.num_computed_tokens_np[live],
                                      plane.sched.arrays.num_computed_tokens[live])


def test_serve_flags_are_checked_by_name():
    p = serve.build_parser()
    with pytest.raises(SystemExit):
        serve.check_args(p, p.parse_args(["--num-prompts", "0"]))
    with pytest.raises(SystemExit):
        serve.check_args(p, p.parse_args(["--request-rate", "0"]))
    with pytest.raises(SystemExit):
        serve.check_args(p, p.parse_args(["--num-clients", "0"]))
    with pytest.raises(SystemExit):
        serve.check_args(p, p.parse_args(["--dataset", "/no/such/file.jsonl"]))
    assert serve.random_prompts(2, 5, 1) == serve.random_prompts(2, 5, 1)


def test_pp_both_workloads_write_the_documented_keys(tmp_path):
    out = tmp_path / "pp.json"
    assert pp.main(["--workload", "both", "--repeats", "1", "--num-requests", "2", "--max-tokens",
                    "3", "--prefill-len", "40", "--max-model-len", "128", "--max-num-seqs", "4",
                    "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert doc["kind"] == "pp" and doc["command"].startswith("python -m runtime.bench pp")
    assert set(res) >= {"throughput_ratio", "efficiency", "ttft_ratio", "decode", "prefill"}
    assert res["efficiency"] == pytest.approx(res["throughput_ratio"] / 2)
    for mode in ("sync", "overlapped"):
        (run,) = res["decode"]["runs"][mode]
        assert run["output_tokens"] == 6 and run["steps"] >= 3
        (pre,) = res["prefill"]["runs"][mode]
        assert pre["output_tokens"] == 1
    sync, over = res["prefill"]["runs"]["sync"][0], res["prefill"]["runs"]["overlapped"][0]
    assert res["ttft_ratio"] == pytest.approx(sync["max_ttft_s"] / over["max_ttft_s"])


def test_pp_calibrate_needs_a_sweep():
    with pytest.raises(SystemExit):
        pp.main(["--calibrate", "--workload", "prefill"])


def test_ratio_summary_is_pairwise():
    r = pp.ratio_summary([2.0, 3.0, 9.0], [1.0, 2.0, 3.0])
    assert r["all"] == [2.0, 1.5, 3.0] and (r["median"], r["min"], r["max"]) == (2.0, 1.5, 3.0)


def test_contention_measures_both_stages_and_fits_the_step_cost(tmp_path):
    from runtime.bench import contention
    out = tmp_path / "contention.json"
    assert contention.main(["--rows", "1,2", "--threads", "1", "--prefixes", "0,16", "--chunk",
                            "8", "--context", "8", "--iters", "1", "--repeats", "1",
                            "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert doc["kind"] == "contention" and doc["command"].startswith("python -m runtime.bench contention")
    assert [(p["kind"], p["rows"], p["prefix"]) for p in res["points"]] == \
        [("decode", 1, 8), ("decode", 2, 8), ("prefill", 1, 0), ("prefill", 1, 16)]
    assert all(len(p["alone_s"]) == 2 and min(p["alone_s"]) > 0 for p in res["points"])
    assert all(min(p["both_s"]) > 0 for p in res["points"] if p["kind"] == "decode")
    assert [c["concurrency"] for c in res["ceilings"]] == [2]
    assert res["step_cost"]["concurrency"] >= 1 and res["step_cost"]["num_samples"] == 4
    assert res["layer_ranges"] == [[0, 19], [19, 30]]
