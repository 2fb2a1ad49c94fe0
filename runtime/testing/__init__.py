"""The ppstate pytest plugin (``runtime.testing.plugin``, entry point ``pytest11: ppstate``).

It lives in ``runtime`` rather than ``ppstate.testing`` because the ``pp_engine`` fixture starts
a real :class:`runtime.engine.AsyncEngine` (asyncio, torch, worker processes), which the pure
``ppstate`` package must not import. The pure helpers stay importable as
``from ppstate.testing import assert_invariants, replay, SimPipeline``.
"""
