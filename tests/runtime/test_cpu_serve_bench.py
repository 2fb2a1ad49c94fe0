"""``python -m runtime.bench cpu-serve`` (issue #34's table): the module imports against the
current serve client, the servers and their flags it runs, and the ratios it reports."""

from __future__ import annotations

from runtime.bench import cpu_serve


def test_commands_run_llama_cpp_first_and_variants_only_when_named():
    args = cpu_serve.build_parser().parse_args(["--llama-server", "/x/llama-server"])
    cmds = cpu_serve.commands(args)
    assert list(cmds) == ["llama.cpp", "fast-pp1", "fast-pp2", "exact-pp1", "exact-pp2"]
    llama = cmds["llama.cpp"]
    assert llama[0] == "/x/llama-server" and llama[llama.index("-np") + 1] == "8"
    assert llama[llama.index("-c") + 1] == str(8 * (64 + 64 + 16))
    assert cmds["fast-pp2"][-6:] == ["--pp", "2", "--cpu-path", "fast", "--kv-cache-memory", "128MB"]
    only = cpu_serve.commands(cpu_serve.build_parser().parse_args(
        ["--only", "fast-pp2-split,fast-pp1"]))
    assert list(only) == ["fast-pp1", "fast-pp2-split"]
    assert "--cpu-threads" in only["fast-pp2-split"]


def test_ratios_against_llama_cpp_and_pp2_over_pp1():
    def srv(one, many):
        return {"single": {"output_throughput": one}, "concurrent_8": {"output_throughput": many}}
    out = cpu_serve.ratios({"llama.cpp": srv(100.0, 160.0), "fast-pp1": srv(50.0, 200.0),
                            "fast-pp2": srv(40.0, 180.0)}, 8)
    assert out["vs_llama_cpp"] == {"fast-pp1": [0.5, 1.25], "fast-pp2": [0.4, 1.125]}
    assert out["fast_pp2_over_pp1_concurrent"] == 0.9


def _run(one, many, cores=1.0):
    keep = {"ttft_mean_ms": 10.0, "tpot_mean_ms": 20.0}
    return {"name": "x", "single": {"output_throughput": one, **keep},
            "concurrent_8": {"output_throughput": many, "tok_per_core_s": many / cores, **keep}}


def test_rounds_merge_to_medians_and_pp2_over_pp1_by_round():
    runs = [_run(10.0, 60.0), _run(30.0, 80.0), _run(20.0, 70.0, cores=2.0)]
    merged = cpu_serve.merge_rounds(runs, 8)
    assert merged["single"]["output_throughput"] == 20.0
    assert merged["concurrent_8"]["output_throughput"] == 70.0
    assert merged["concurrent_8"]["tok_per_core_s"] == 60.0   # median of 60, 80, 35
    assert merged["rounds"] == [[10.0, 60.0], [30.0, 80.0], [20.0, 70.0]]
    pp2 = cpu_serve.merge_rounds([_run(9.0, 66.0), _run(9.0, 72.0), _run(9.0, 84.0)], 8)
    out = cpu_serve.round_ratios({"fast-pp1": merged, "fast-pp2": pp2,
                                  "fast-pp2-lanes": pp2, "exact-pp2": pp2}, 8)
    assert out == {"fast-pp2": [1.1, 0.9, 1.2], "fast-pp2-lanes": [1.1, 0.9, 1.2]}


def test_all_lanes_variant_runs_only_when_named():
    cmds = cpu_serve.commands(cpu_serve.build_parser().parse_args([]))
    assert "fast-pp2-lanes" not in cmds
    only = cpu_serve.commands(cpu_serve.build_parser().parse_args(
        ["--only", "fast-pp1,fast-pp2-lanes", "--rounds", "3"]))
    assert "--no-adaptive-lanes" in only["fast-pp2-lanes"]
