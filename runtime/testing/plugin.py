"""pytest plugin of ppstate: ``sim_pipeline``, ``pp_engine``, ``--ppstate-trace-dir``.

Registered through the ``pytest11`` entry point ``ppstate`` (pyproject.toml), so installing
ppstate is enough: no conftest. Fixtures:

* ``sim_pipeline(config=None, seed=0, **SimConfig fields) -> ppstate.testing.SimPipeline``: a
  deterministic simulated pipeline running the real scheduler (pure Python, milliseconds).
* ``pp_engine(pp_size=2, model="default", **EngineConfig fields) -> AsyncEngine`` (await it):
  a real engine with one worker process per rank over gloo. Every engine made by it is shut down
  when the test ends, passed or failed; the test then fails if any of its worker processes is
  still alive. Needs pytest-asyncio (``pip install 'ppstate[test]'``).

Every engine records a trace; with ``--ppstate-trace-dir DIR`` under ``DIR/<test id>/run-*``,
otherwise under the test's ``tmp_path``. A simulated pipeline of a failing test is written as a
trace there too. A failing test's report gets a ``ppstate traces`` section listing those run
directories (replay them with ``python -m ppstate.replay RUN_DIR``).

Helpers: ``from ppstate.testing import assert_invariants, replay``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ppstate.testing import SimPipeline
from ppstate.sim.workload import SimConfig

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - pp_engine reports it when used
    pytest_asyncio = None

TRACES = pytest.StashKey[list]()      # run directories of the test's engines / pipelines
PIPELINES = pytest.StashKey[list]()   # (SimPipeline, trace base) of the test


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppstate")
    group.addoption("--ppstate-trace-dir", default=None, metavar="DIR",
                    help="ppstate: engines and simulated pipelines made through the fixtures "
                         "record their traces under DIR/<test id>/ (replay: python -m "
                         "ppstate.replay RUN_DIR)")


def _trace_base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                what: str) -> Path:
    opt = request.config.getoption("--ppstate-trace-dir")
    if opt is None:
        return tmp_path_factory.mktemp(f"ppstate-{what}")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_")[:200]
    return Path(opt) / name


@pytest.fixture
def sim_pipeline(request, tmp_path_factory):
    """Factory of :class:`ppstate.testing.SimPipeline`:
    ``sim_pipeline(config=None, seed=0, **SimConfig fields)``."""
    made = request.node.stash.setdefault(PIPELINES, [])

    def make(config: SimConfig | None = None, seed: int = 0, **fields) -> SimPipeline:
        cfg = config or SimConfig(**fields)
        if config is not None and fields:
            import dataclasses
            cfg = dataclasses.replace(config, **fields)
        pipe = SimPipeline(cfg, seed=seed)
        made.append((pipe, _trace_base(request, tmp_path_factory, "sim")))
        return pipe
    return make


def _engine_fixture(fn):
    if pytest_asyncio is None:
        def missing():
            pytest.fail("pp_engine needs pytest-asyncio: pip install 'ppstate[test]'")
        missing.__name__, missing.__doc__ = fn.__name__, fn.__doc__
        return pytest.fixture(missing)
    return pytest_asyncio.fixture(fn)


@_engine_fixture
async def pp_engine(request, tmp_path_factory):
    """Async factory of real engines: ``engine = await pp_engine(pp_size=2, model="default",
    **EngineConfig fields)``; all are shut down after the test, worker processes checked gone."""
    from runtime.testing.engines import EngineFactory, alive_pids
    traces = request.node.stash.setdefault(TRACES, [])
    factory = EngineFactory(_trace_base(request, tmp_path_factory, "engine"), traces.append)
    try:
        yield factory
    finally:
        errors = await factory.close()
        left = alive_pids(factory.pids)
        if left or errors:
            pytest.fail(f"pp_engine teardown: worker processes still alive {left}; {errors}",
                        pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call" and report.failed:
        paths = list(item.stash.get(TRACES, []))
        for pipe, base in item.stash.get(PIPELINES, []):
            try:
                paths.append(str(pipe.write_trace(base)))
            except OSError as exc:
                paths.append(f"(simulated pipeline trace not written: {exc})")
        if paths:
            report.sections.append(("ppstate traces", "\n".join(
                [f"trace: {p}" for p in paths]
                + ["replay: python -m ppstate.replay RUN_DIR [--explain REQ_ID]"])))
    return report
