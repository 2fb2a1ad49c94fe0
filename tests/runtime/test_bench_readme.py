"""The README's benchmark table is generated from benchmarks/results/*.json and must match them."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
readme_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_table)


def test_readme_table_matches_the_results_files():
    assert readme_table.main(["--check"]) == 0, \
        "README.md's benchmark table is stale: run python benchmarks/readme_table.py"


def _doc(date, results, kind="pp"):
    return {"kind": kind, "date": date, "machine": "m", "command": f"cmd {date}", "args": {},
            "results": results}


def test_render_takes_each_metric_from_the_newest_file(tmp_path):
    spread = {"median": 1.5, "min": 1.2, "max": 1.7, "all": [1.2, 1.5, 1.7]}
    (tmp_path / "a.json").write_text(json.dumps(_doc("2026-01-01", {
        "throughput_ratio": 1.1, "decode": {"throughput_ratio_spread": spread}, "ttft_ratio": 1.9})))
    (tmp_path / "b.json").write_text(json.dumps(_doc("2026-02-01", {
        "throughput_ratio": 1.5, "decode": {"throughput_ratio_spread": spread}})))
    (tmp_path / "c.json").write_text(json.dumps(_doc("2026-01-05", {"results": [
        {"live": 256, "us_per_step": 80.4, "all_us_per_step": [79.0, 80.4, 91.0]}]}, "sched")))
    (tmp_path / "gpu.json").write_text(json.dumps({"kind": "gpu"}))
    text = readme_table.render(readme_table.load_results(tmp_path))
    assert "| decode throughput overlapped / sync (PP=2) | 1.50 | 1.20 .. 1.70 | >= 1.8 | `b.json` |" in text
    assert "| long-prompt TTFT sync / overlapped | 1.90 |  | >= 1.6 | `a.json` |" in text
    assert "256 live | 80 us/step | 79 .. 91 |" in text
    assert "* `cmd 2026-02-01`" in text and "* `cmd 2026-01-01`" in text


def test_replace_block_needs_the_markers():
    with pytest.raises(ValueError, match="markers"):
        readme_table.replace_block("no markers here", "x")
    start, end = readme_table.START, readme_table.END
    assert readme_table.replace_block(f"a{start}old{end}b", "new") == f"a{start}\nnew\n{end}b"


def test_render_adds_the_newest_cpu_serving_table(tmp_path):
    def serving(date, tps):
        servers = {n: {"single": {"output_throughput": a}, "concurrent_8": {"output_throughput": b},
                       "rss_mib": {"server": 300.0, "children": [rss, 12.0]}}
                   for n, (a, b, rss) in tps.items()}
        ratios = {"vs_llama_cpp": {"fast-pp1": [0.5, 1.25]}, "fast_pp2_over_pp1_concurrent": 0.9}
        doc = _doc(date, {"servers": servers, "ratios": ratios}, "cpu_serve")
        doc["args"] = {"concurrency": 8, "input_len": 64, "output_len": 64, "kv_cache_memory": "128MB"}
        return json.dumps(doc)
    (tmp_path / "old.json").write_text(serving("2026-01-01T00:00", {"fast-pp1": (1.0, 2.0, 900.0)}))
    (tmp_path / "new.json").write_text(serving("2026-02-01T00:00", {
        "llama.cpp": (100.0, 160.0, 150.0), "fast-pp1": (50.0, 200.0, 1000.0)}))
    text = readme_table.render(readme_table.load_results(tmp_path))
    assert "(`new.json`, 2026-02-01T00:00 UTC)" in text and "old.json" not in text
    assert ("EOS ignored, ppstate ranks with `--kv-cache-memory 128MB` (a KV cache of 128MB each; "
            "`make serve` sizes it for `--max-num-seqs` x `--max-model-len`, so its ranks are "
            "larger) (`new.json`") in text     # what the rank RSS column was measured with
    assert "| llama.cpp | 100.0 | 160.0 | - | 150 |" in text
    assert "| fast-pp1 | 50.0 | 200.0 | 0.50 / 1.25 | 1000 |" in text
    assert "PP=2 / PP=1 at 8 streams: fast 0.90." in text


def test_later_cpu_serving_runs_without_llama_cpp_add_a_line(tmp_path):
    def serving(date, names, rounds):
        servers = {n: {"single": {"output_throughput": 10.0},
                       "concurrent_8": {"output_throughput": tps},
                       "rss_mib": {"server": 300.0, "children": [900.0]}} for n, tps in names.items()}
        ratios = {"pp2_over_pp1_concurrent_by_round": {"fast-pp2": [0.9, 1.1]}} if rounds > 1 else {}
        doc = _doc(date, {"servers": servers, "ratios": ratios}, "cpu_serve")
        doc["args"] = {"concurrency": 8, "input_len": 64, "output_len": 64, "rounds": rounds}
        return json.dumps(doc)
    (tmp_path / "full.json").write_text(serving("2026-01-01T00:00", {"llama.cpp": 90.0, "fast-pp1": 100.0}, 1))
    (tmp_path / "ab.json").write_text(serving("2026-02-01T00:00", {"fast-pp1": 80.0, "fast-pp2": 84.5}, 2))
    text = readme_table.render(readme_table.load_results(tmp_path))
    assert "(`full.json`, 2026-01-01T00:00 UTC)" in text and "| llama.cpp | 10.0 | 90.0 |" in text
    assert ("Later A/B run (`ab.json`, 2026-02-01T00:00 UTC, 2 round(s), servers taking turns): 8 "
            "streams output tok/s (median) fast-pp1 80.0, fast-pp2 84.5; PP=2 / PP=1 by round: "
            "fast-pp2 / fast-pp1 0.90, 1.10.") in text


def test_listed_commands_point_inside_the_repository():
    cmd = ("python -m runtime.bench cpu-serve --llama-server /work/x/build/bin/llama-server "
           "--model /tmp/smol --rounds 3 --json-out /tmp/cpu34/lanes.json")
    assert readme_table.repo_command("cpu-serve-2026-12-03-lanes.json", cmd) == (
        "python -m runtime.bench cpu-serve --llama-server LLAMA_SERVER --model MODEL_FOLDER "
        "--rounds 3 --json-out benchmarks/results/cpu-serve-2026-12-03-lanes.json")
    kept = "python -m runtime.bench sched --json-out benchmarks/results/sched-2026-12-02.json"
    assert readme_table.repo_command("other.json", kept) == kept
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("Commands (`MODEL_FOLDER`"):]
    assert "/tmp/" not in block and "/work/" not in block and "/root/" not in block
