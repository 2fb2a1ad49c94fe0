"""``runtime.bench.spec --alternate``: engines served run by run in turn, the first one rotating
per round, best run kept, every run and the median reported (#33)."""

import asyncio

import pytest

from runtime.bench import spec


class _Engine:
    def __init__(self, k, log):
        self.k, self.log = k, log

    async def shutdown(self):
        self.log.append(("shutdown", self.k))


def test_engines_alternate_run_by_run_and_keep_their_best(monkeypatch):
    log, rates = [], {0: [5.0, 7.0, 6.5], 2: [9.0, 4.0, 3.0]}

    async def start(cfg):
        log.append(("start", cfg))
        return _Engine(cfg, log)

    async def serve(engine, batch, max_tokens, concurrency=None, temperature=0.0):
        if max_tokens == 8:   # the warm-up
            log.append(("warm", engine.k))
            return {}
        log.append(("run", engine.k, temperature))
        return {"output_tokens_per_s": rates[engine.k].pop(0), "k": engine.k}

    monkeypatch.setattr(spec.AsyncEngine, "start", start)
    monkeypatch.setattr(spec, "_serve", serve)
    res = asyncio.run(spec.run_alternated({0: 0, 2: 2}, {"w": [[1, 2, 3]]}, 64, repeats=3,
                                          temperature=1.0))
    assert log == [("start", 0), ("warm", 0), ("start", 2), ("warm", 2),
                   ("run", 0, 1.0), ("run", 2, 1.0), ("run", 2, 1.0), ("run", 0, 1.0),
                   ("run", 0, 1.0), ("run", 2, 1.0), ("shutdown", 0), ("shutdown", 2)]
    assert res == {0: {"w": {"output_tokens_per_s": 7.0, "k": 0,
                             "runs_tokens_per_s": [5.0, 7.0, 6.5], "runs_position": [0, 1, 0],
                             "median_tokens_per_s": 6.5}},
                   2: {"w": {"output_tokens_per_s": 9.0, "k": 2,
                             "runs_tokens_per_s": [9.0, 4.0, 3.0], "runs_position": [1, 0, 1],
                             "median_tokens_per_s": 4.0}}}


def test_report_gives_ratio_of_medians_and_median_of_paired_ratios(monkeypatch, tmp_path):
    import json

    def run(k, rates):
        return {"unfriendly": {"output_tokens_per_s": max(rates), "token_ids": [[1]],
                               "runs_tokens_per_s": rates, "runs_position": [0, 1, 2],
                               "median_tokens_per_s": sorted(rates)[1]}}

    async def alternated(configs, batches, *a, **kw):
        assert sorted(configs) == [0, 2]
        return {0: run(0, [100.0, 200.0, 150.0]), 2: run(2, [90.0, 210.0, 120.0])}

    monkeypatch.setattr(spec, "run_alternated", alternated)
    out = tmp_path / "r.json"
    assert spec.main(["--model", str(tmp_path), "--spec-list", "2", "--workloads", "unfriendly",
                      "--alternate", "--out", str(out)]) == 0
    k2 = json.loads(out.read_text())["workloads"]["unfriendly"]["k2"]
    assert (k2["speedup"], k2["speedup_median"], k2["speedup_paired_median"]) == (
        210.0 / 200.0, 120.0 / 150.0, 0.9)


def test_adjusted_speedups_factor_out_round_and_place():
    """Rates made of a round factor x an engine factor x a place factor (the rotation of three
    engines over three rounds): the fit gives back the engine factors relative to off."""
    import math
    rounds, engine, place = [300.0, 420.0, 360.0], {0: 1.0, 2: 0.9, 4: 1.1}, [0.95, 1.05, 1.0]
    order = [0, 2, 4]
    runs = {k: ([], []) for k in order}
    for r in range(3):
        turn = order[r:] + order[:r]
        for p, k in enumerate(turn):
            runs[k][0].append(rounds[r] * engine[k] * place[p])
            runs[k][1].append(p)
    adj = spec.adjusted_speedups(runs)
    assert sorted(adj) == [2, 4]
    assert math.isclose(adj[2], 0.9, rel_tol=1e-9) and math.isclose(adj[4], 1.1, rel_tol=1e-9)


@pytest.mark.parametrize("argv, flag", [
    (["--spec-list", "2,abc"], "--spec-list"),    # was a ValueError traceback
    (["--spec-list", "-1"], "--spec-list"),       # was a SchedulerError traceback
    (["--spec-list", "99"], "--spec-list"),       # was workers dying while loading
    (["--spec-list", "0"], "--spec-list"),        # ran off against off
    (["--spec-list", "2,2"], "--spec-list"),
    (["--workloads", "bogus"], "--workloads"),    # ran the friendly workload under that name
    (["--repeats", "0"], "--repeats"),            # max() of no runs, after the engines started
    (["--num-requests", "0"], "--num-requests"),
    (["--concurrency", "0"], "--concurrency"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),   # was a pydantic traceback from the first run
    (["--temperature", "nan"], "--temperature"),
])
def test_bad_bench_flags_exit_2_naming_the_flag_before_any_engine(argv, flag, monkeypatch, capsys):
    def ran(*a, **k):
        raise AssertionError("an engine was started")
    monkeypatch.setattr(spec, "run_one", ran)
    monkeypatch.setattr(spec, "run_alternated", ran)
    with pytest.raises(SystemExit) as exc:
        spec.main(argv + ["--out", "/dev/null"])
    assert exc.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err


def test_good_bench_flags_parse_to_lists():
    from runtime.bench import spec_args
    assert spec_args.spec_list("2,4") == [2, 4]
    assert spec_args.workloads("friendly,unfriendly") == ["friendly", "unfriendly"]
    assert (spec_args.positive_int("3"), spec_args.temperature("0")) == (3, 0.0)
