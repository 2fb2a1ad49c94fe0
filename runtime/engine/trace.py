"""The engine's trace run directory (docs/trace_format.md) and the scheduler configuration it
records."""

from __future__ import annotations

import dataclasses
import sys
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
    """Create a new run directory under ``config.trace_dir`` and write its header. Warns on
    stderr when the trace will not replay (:func:`unreplayable_warning`)."""
    run_dir = new_run_dir(config.trace_dir)
    write_trace_header(run_dir, config, scheduler_config(config))
    if (warning := unreplayable_warning(config)) is not None:
        print(warning, file=sys.stderr, flush=True)
    return run_dir


def unreplayable_warning(config: EngineConfig) -> str | None:
    """The warning for a speculative run with the n-gram probe on, traced without prompt ids:
    ``python -m ppstate.replay`` refuses such a trace (the probe reads the prompts;
    ``ppstate.replay.replayer.refusal``). None when the trace will replay."""
    sc = config.scheduler
    if not (sc.num_spec_tokens and sc.spec_probe_ngram) or config.trace_prompts:
        return None
    return (f"warning: --spec-tokens {sc.num_spec_tokens} is traced without --trace-prompts: "
            f"python -m ppstate.replay will refuse this trace (the scheduler's n-gram probe, "
            f"--spec-probe-ngram {sc.spec_probe_ngram}, reads the prompt ids); add "
            f"--trace-prompts to replay it")


def write_trace_header(run_dir: Path, config: EngineConfig, sched: SchedulerConfig) -> None:
    """(Re)write ``header.json`` of ``run_dir``; the scheduler's config must be the one replay
    rebuilds the scheduler with (its KV block count is known only once the ranks loaded)."""
    write_header(run_dir, "engine", sched, config.model_dump(),
                 trace_prompts=config.trace_prompts, versions=package_versions("torch"))
