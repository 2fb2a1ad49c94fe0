"""Test helpers for ppstate users (pure: no torch, no asyncio).

``from ppstate.testing import assert_invariants, replay, SimPipeline``. The pytest fixtures
(``sim_pipeline``, ``pp_engine``, the ``--ppstate-trace-dir`` option) come from the plugin
``runtime.testing.plugin``, registered through the ``pytest11`` entry point: it lives in
``runtime`` because ``pp_engine`` starts a real ``AsyncEngine``, which ``ppstate`` may not import.
"""

from ppstate.testing.invariants import (INVARIANT_NAMES, InvariantViolation, assert_invariants,
                                        explain, replay)
from ppstate.testing.sim_pipeline import SimPipeline

__all__ = ["assert_invariants", "replay", "explain", "InvariantViolation", "INVARIANT_NAMES",
           "SimPipeline"]
