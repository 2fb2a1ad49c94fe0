"""The engine flags come from one table (runtime.cli_common.ENGINE_FLAGS) over EngineConfig, which
contains the scheduler's SchedulerConfig; the docs table is generated from the same table."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from ppstate.budget import SchedulerConfig
from runtime.cli_common import ENGINE_FLAGS, add_engine_flags, documented_table, engine_config, markdown_table
from runtime.config import EngineConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_engine_flags(p)
    return p


def test_docs_table_is_the_generated_one():
    assert documented_table() == markdown_table(), \
        "docs/config.md is stale: run python -m runtime.cli_common --write-docs"


def test_every_config_field_has_one_flag():
    fields = {f.field for f in ENGINE_FLAGS}
    assert len(fields) == len(ENGINE_FLAGS) == len({f.name for f in ENGINE_FLAGS})
    engine = {n for n in EngineConfig.model_fields if n != "scheduler"}
    # num_kv_blocks: reported by the ranks (--kv-cache-memory); cost_*: read from --step-cost FILE
    sched = {f"scheduler.{f.name}" for f in dataclasses.fields(SchedulerConfig)
             if f.name != "num_kv_blocks" and not f.name.startswith("cost_")}
    assert fields == engine | sched


def test_defaults_are_the_config_defaults():
    p = parser()
    cfg = engine_config(p, p.parse_args([]))
    assert cfg == EngineConfig(launcher="spawn")
    assert (cfg.scheduler.pp_size, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
            cfg.scheduler.max_prefill_chunk, cfg.scheduler.mode) == (2, 32, 512, 128, "overlapped")


def test_flags_set_their_fields():
    p = parser()
    cfg = engine_config(p, p.parse_args(["--pp", "3", "--pp-schedule", "sync", "--max-model-len", "64",
                                         "--no-enable-prefix-caching", "--enforce-eager",
                                         "--step-timeout", "7.5", "--dtype", "float16"]))
    assert cfg.scheduler == SchedulerConfig(pp_size=3, mode="sync", max_model_len=64,
                                            enable_prefix_caching=False, max_num_seqs=32,
                                            max_num_batched_tokens=512, max_prefill_chunk=128,
                                            spec_probe_ngram=3)
    assert (cfg.enforce_eager, cfg.step_timeout_s, cfg.dtype) == (True, 7.5, "float16")


@pytest.mark.parametrize("argv, flag", [
    (["--max-num-seqs", "5000"], "--max-num-seqs"),   # engine bound on a scheduler field
    (["--block-size", "0"], "--block-size"),
    (["--torch-threads", "0"], "--torch-threads"),   # an engine field
    (["--validate-mirrors", "sometimes"], "--validate-mirrors"),
    (["--spec-tokens", "-1"], "--spec-tokens"),
    (["--spec-tokens", "17"], "--spec-tokens"),
    (["--spec-ngram", "0"], "--spec-ngram"),
    (["--spec-probe-ngram", "-1"], "--spec-probe-ngram"),   # was a SchedulerError traceback, exit 1
])
def test_bad_value_names_the_flag(argv, flag, capsys):
    p = parser()
    with pytest.raises(SystemExit) as exc:
        engine_config(p, p.parse_args(argv))
    assert exc.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err


def test_flat_and_nested_scheduler_fields_are_one_config():
    flat = EngineConfig(pp_size=3, max_model_len=64)
    assert flat == EngineConfig(scheduler={"pp_size": 3, "max_model_len": 64})
    assert flat.scheduler.num_kv_blocks == 32 * 4  # 32 slots x ceil(64 / 16) blocks, derived again
    assert EngineConfig(**flat.model_dump()) == flat   # what a worker process receives
    given = SchedulerConfig(pp_size=4)
    assert EngineConfig(scheduler=given).scheduler is given
    with pytest.raises(ValidationError, match="max_prefill_chunk must be <= max_num_batched_tokens"):
        EngineConfig(max_prefill_chunk=64, max_num_batched_tokens=32)
