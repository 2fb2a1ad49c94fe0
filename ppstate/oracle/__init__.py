"""The verification layer: what the tools judge a run against, used by the simulator
(``ppstate.sim``), the trace replayer and the model checker (``ppstate.check``), never by the core.

:mod:`~ppstate.oracle.model` holds the reference token rule and EOS / vocabulary constants,
:mod:`~ppstate.oracle.invariants` the invariant checker (specs/invariants.md). Imports only the
core (docs/architecture.md).
"""
