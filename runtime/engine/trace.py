"""The engine's trace run directory (docs/trace_format.md) and the scheduler configuration it
records."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ppstate.budget import SchedulerConfig
from ppstate.trace.run import new_run_dir, package_versions, write_header
from runtime.config import EngineConfig


def scheduler_config(config: EngineConfig, num_kv_blocks: int | None = None) -> SchedulerConfig:
    """The scheduler's configuration: the engine's, with ``num_kv_blocks`` the smallest KV block
    count the ranks reported after loading (None before the workers started: room for
    ``max_model_len`` tokens in every slot). A ``step_cost`` file replaces the step-cost
    coefficients (``cost_*``, issue 11)."""
    from runtime.config import load_step_cost
    cost = load_step_cost(config.step_cost) if config.step_cost else {}
    return dataclasses.replace(config.scheduler, num_kv_blocks=num_kv_blocks,
                               **{f"cost_{k}": v for k, v in cost.items()})


def start_trace_run(config: EngineConfig) -> Path:
    """Create a new run directory under ``config.trace_dir`` and write its header."""
    run_dir = new_run_dir(config.trace_dir)
    write_trace_header(run_dir, config, scheduler_config(config))
    return run_dir


def write_trace_header(run_dir: Path, config: EngineConfig, sched: SchedulerConfig) -> None:
    """(Re)write ``header.json`` of ``run_dir``; the scheduler's config must be the one replay
    rebuilds the scheduler with (its KV block count is known only once the ranks loaded)."""
    write_header(run_dir, "engine", sched, config.model_dump(),
                 trace_prompts=config.trace_prompts, versions=package_versions("torch"))
