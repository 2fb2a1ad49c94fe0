"""Replay of recorded runs (``docs/trace_format.md``): the tool that re-drives the real scheduler
and the real rank step order from a trace and checks it, without the model or any GPU.

Modules: :mod:`~ppstate.replay.replayer` (:func:`replay`), :mod:`~ppstate.replay.engine` (the
scheduler side), :mod:`~ppstate.replay.rank` (a rank's backend of the step order),
:mod:`~ppstate.replay.checks` (invariants on a recording), :mod:`~ppstate.replay.compare`,
:mod:`~ppstate.replay.explain`, :mod:`~ppstate.replay.timeline` and :mod:`~ppstate.replay.cli`
(``python -m ppstate.replay``). Imports the core, the trace format (:mod:`ppstate.trace`) and the
verification layer (:mod:`ppstate.oracle`); nothing of ``ppstate.sim`` or ``ppstate.check``.
"""

from ppstate.replay.cli import main
from ppstate.replay.replayer import ReplayFailure, ReplayResult, replay

__all__ = ["replay", "ReplayResult", "ReplayFailure", "main"]
