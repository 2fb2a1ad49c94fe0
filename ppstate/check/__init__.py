"""Bounded model checker of the real scheduler, PPHandlers, mirrors and rank step order
(``python -m ppstate.check``; docs/checker.md)."""

from ppstate.check.explore import CheckResult, explore
from ppstate.check.world import CheckConfig

__all__ = ["CheckConfig", "CheckResult", "explore"]
