"""Simulator runs written as replayable traces (``docs/trace_format.md``, source ``sim``).

The simulator is deterministic (one seed draws the whole workload), so a run that found a
violation is recorded by running the same configuration again with a recording sink: the clean
case pays nothing. The trace holds the header and ``engine.jsonl`` (the scheduler's inputs and
decisions); simulated ranks are re-derived by replay, not recorded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ppstate.events import RecordingSink
from ppstate.sim.simulator import SimResult, Simulator
from ppstate.sim.workload import SimConfig
from ppstate.trace.run import write_run

#: where ``python -m ppstate.sim`` writes the trace of a failing run when no --trace-dir is given
DEFAULT_SIM_TRACE_DIR = "sim-traces"


def record_sim(cfg: SimConfig, trace_dir: str | Path) -> tuple[SimResult, Path]:
    """Run ``cfg`` once with the scheduler's events recorded; write them as a new run directory
    under ``trace_dir``. Returns the result and the run directory."""
    sink = RecordingSink()
    sim = Simulator(cfg, sink=sink)
    result = sim.run()
    header = dataclasses.asdict(cfg)
    if not cfg.scheduler.num_spec_tokens:   # a run without speculation: the header it always had
        del header["spec_acceptance"]
    run_dir = write_run(trace_dir, "sim", sim.sched.config, header, sink.events, seed=cfg.seed)
    return result, run_dir
