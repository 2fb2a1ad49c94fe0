"""Simulator runs written as replayable traces (``docs/trace_format.md``, source ``sim``).

The simulator is deterministic (one seed draws the whole workload), so a run that found a
violation is recorded by running the same configuration again with a recording sink: the clean
case pays nothing. The trace holds the header and ``engine.jsonl`` (the scheduler's inputs and
decisions). The simulated ranks are not recorded: replay re-derives the scheduler only, so the
header carries what the simulator itself found (``recorded_violations``, the first
:data:`~ppstate.oracle.invariants.MAX_REPORTED`, and ``num_recorded_violations``), the mutants
switched on and ``repro``, the command that re-runs the ranks; replay reports them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ppstate import mutants
from ppstate.events import RecordingSink
from ppstate.sim.simulator import SimResult, Simulator, repro_command
from ppstate.sim.workload import SimConfig
from ppstate.trace.run import write_run

#: where ``python -m ppstate.sim`` writes the trace of a failing run when no --trace-dir is given
DEFAULT_SIM_TRACE_DIR = "sim-traces"


def record_sim(cfg: SimConfig, trace_dir: str | Path,
               repro: str | None = None) -> tuple[SimResult, Path]:
    """Run ``cfg`` once with the scheduler's events recorded; write them as a new run directory
    under ``trace_dir``. Returns the result and the run directory.

    Args:
        repro: the command line that re-runs this simulation (the CLI passes the user's own);
            default: :func:`~ppstate.sim.simulator.repro_command` of ``cfg`` with the active
            mutants (None for an explicit ``cfg.workload``, which no command line gives).
    """
    sink = RecordingSink()
    sim = Simulator(cfg, sink=sink)
    result = sim.run()
    header = dataclasses.asdict(cfg)
    if not cfg.scheduler.num_spec_tokens:   # a run without speculation: the header it always had
        del header["spec_acceptance"]
    active = mutants.active_names()
    if repro is None and cfg.workload is None:
        repro = repro_command(cfg, json_out=False) + "".join(f" --mutant {m}" for m in active)
    extra = {"recorded_violations": result.invariant_violations,
             "num_recorded_violations": result.num_violations, "mutants": active, "repro": repro}
    run_dir = write_run(trace_dir, "sim", sim.sched.config, header, sink.events, seed=cfg.seed,
                        extra=extra)
    return result, run_dir
