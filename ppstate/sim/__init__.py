"""The deterministic pipeline-parallel simulator: the real scheduler and the real step order
(:class:`ppstate.rank_step.RankStep`) over simulated ranks, with invariant checks at every tick.

Modules: :mod:`~ppstate.sim.simulator` (event loop, timing rules), :mod:`~ppstate.sim.rank` (a
rank's backend: device model, mirrors, KV), :mod:`~ppstate.sim.kv` (KV cache contents),
:mod:`~ppstate.sim.workload` (seeded workload and config; the invariant checker and the token
rule are the verification layer's, :mod:`ppstate.oracle`), :mod:`~ppstate.sim.trace` (recording a run), :mod:`~ppstate.sim.cli`
(``python -m ppstate.sim``), :mod:`~ppstate.sim.soak` (``python -m ppstate.sim.soak``).
"""

from ppstate.sim.cli import run_cli as main
from ppstate.sim.simulator import SimResult, Simulator, repro_command, run_sim
from ppstate.sim.workload import SimConfig

__all__ = ["SimConfig", "SimResult", "Simulator", "main", "repro_command", "run_sim"]
