"""The import graph of ``ppstate`` and ``runtime``, read statically (``ast``; nothing is imported).

Rules (docs/design.md §3): no import cycle between modules, not even through imports under
``if TYPE_CHECKING:`` (a module that names another only for type hints is still a cycle of design);
the core ``ppstate`` imports no torch, torch.distributed, asyncio, zmq and nothing of ``runtime``;
inside ``runtime`` the layers run one way: ``runtime.model`` imports nothing of the worker, the
engine or the sampling package, and ``runtime.sampling`` nothing of the worker or the engine;
inside ``ppstate`` the tools stand above the core (docs/architecture.md): the core imports none of
them, the trace format and the verification layer (``ppstate.oracle``) import only the core, and
the simulator, the model checker and the replayer import the core, the trace format and the oracle
but not each other. Every import statement counts, also one inside a function (a lazy import still makes a cycle at run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ppstate", "runtime")
FORBIDDEN_IN_CORE = ("torch", "asyncio", "zmq", "runtime")  # torch covers torch.distributed


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the two packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_names(module: str, path: Path, typing_too: bool = False) -> set[str]:
    """Every dotted name an import statement of ``path`` names (``from a import b``: ``a.b``, which
    :func:`import_graph` maps to module ``a.b`` or, if ``b`` is no module, to ``a``; relative
    imports resolved), except under ``if TYPE_CHECKING:`` unless ``typing_too``. Parent packages, which Python imports
    first, are not edges: each package's own imports are read from its ``__init__``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)} if not typing_too else set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[:len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph(typing_too: bool = False) -> nx.DiGraph:
    """Module -> module it imports, within the two packages (longest module prefix of a name);
    ``typing_too``: imports under ``if TYPE_CHECKING:`` count as well."""
    files = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for name in imported_names(module, path, typing_too):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph.add_edge(module, name)
    return graph


def test_graph_sees_the_known_edges():
    """The reader is not blind: edges that exist today, a lazy one, a relative-free one, and one
    seen only when ``TYPE_CHECKING`` imports count."""
    g = import_graph()
    assert g.has_edge("runtime.engine.async_engine", "ppstate.scheduler")
    assert g.has_edge("runtime.engine.launcher", "runtime.engine.torchrun")
    assert g.has_edge("runtime.engine.torchrun", "runtime.engine.plan")  # inside a function
    assert g.has_edge("runtime.engine.admission", "runtime.sampling.batch")  # on purpose (design.md §3)
    assert not g.has_edge("runtime.sampling.batch", "runtime.sampling_params")  # TYPE_CHECKING only
    assert import_graph(typing_too=True).has_edge("runtime.sampling.batch", "runtime.sampling_params")


def test_no_import_cycles_even_through_type_checking_imports():
    """A module that only names another for type hints is still a cycle of design (the scheduler
    and its row builder were one until the builder took a Protocol; the sampler and its penalties
    until the sampling batch got its own module)."""
    g = import_graph(typing_too=True)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"
    assert not g.has_edge("ppstate.scheduler_rows", "ppstate.scheduler")
    assert not g.has_edge("runtime.sampling.penalties", "runtime.sampling.sampler")


@pytest.mark.parametrize("package, forbidden", [
    ("runtime.model", ("runtime.worker", "runtime.engine", "runtime.server", "runtime.sampling")),
    ("runtime.sampling", ("runtime.worker", "runtime.engine", "runtime.server")),
])
def test_runtime_layers_import_one_way(package, forbidden):
    """The model (layers, stages, its kernels) stands below the worker, and sampling below the
    worker and the engine: none of them imports a layer above it, type-only imports included."""
    g = import_graph(typing_too=True)
    bad = sorted((m, n) for m, n in g.edges if (m == package or m.startswith(package + "."))
                 and any(n == f or n.startswith(f + ".") for f in forbidden))
    assert bad == []


#: the layers of ``ppstate`` (docs/architecture.md) and what each may import besides itself
PPSTATE_LAYERS = {
    "core": (),
    "trace": ("core",),
    "oracle": ("core",),
    "sim": ("core", "trace", "oracle"),
    "check": ("core", "trace", "oracle"),
    "replay": ("core", "trace", "oracle"),
    "diagrams": ("core",),
    "testing": ("core", "trace", "oracle", "sim", "check", "replay"),
}
#: imports still running up, each to be removed by a named change (empty when done)
PENDING_UPWARD: set[tuple[str, str]] = set()


def ppstate_layer(module: str) -> str:
    """The layer of a ``ppstate`` module: its subpackage when that is a tool, else ``core``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PPSTATE_LAYERS else "core"


def test_ppstate_tools_stand_above_the_core():
    """No import runs back up from the core into a tool, none between the simulator, the checker
    and the replayer, none from the trace format or the oracle into a tool (type-only included)."""
    g = import_graph(typing_too=True)
    bad = sorted((m, n) for m, n in g.edges if m.startswith("ppstate") and n.startswith("ppstate")
                 and ppstate_layer(n) != ppstate_layer(m)
                 and ppstate_layer(n) not in PPSTATE_LAYERS[ppstate_layer(m)]
                 and (m, n) not in PENDING_UPWARD)
    assert bad == []
    assert all(g.has_edge(*e) for e in PENDING_UPWARD)  # a pending edge that is gone: drop it


def test_layer_rules_are_not_blind():
    """The layer test sees the edges it judges: the tools do import the oracle and the format,
    and a tool module is told from a core one."""
    g = import_graph(typing_too=True)
    assert g.has_edge("ppstate.replay.checks", "ppstate.oracle.invariants")
    assert g.has_edge("ppstate.check.monitor", "ppstate.oracle.invariants")
    assert g.has_edge("ppstate.sim.trace", "ppstate.trace.run")
    assert g.has_edge("ppstate.scheduler", "ppstate.codec")   # the codec is the core's own
    assert ppstate_layer("ppstate.scheduler") == "core" and ppstate_layer("ppstate.sim.rank") == "sim"


def test_core_imports_no_runtime_torch_asyncio_zmq():
    files = module_files()
    bad = sorted((m, name) for m, p in files.items() if m.split(".")[0] == "ppstate"
                 for name in imported_names(m, p)
                 if name.split(".")[0] in FORBIDDEN_IN_CORE)
    assert bad == []


def test_model_package_imports_no_core():
    """``runtime.model`` (loaders, layers, tokenizer) stands on its own: its errors have their own
    root, and nothing there imports ``ppstate``."""
    files = module_files()
    bad = sorted((m, name) for m, p in files.items() if m.startswith("runtime.model")
                 for name in imported_names(m, p) if name.split(".")[0] == "ppstate")
    assert bad == []


@pytest.mark.parametrize("source, expected", [
    ("import torch.distributed as dist", {"torch.distributed"}),
    ("from . import events", {"ppstate.events"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", {"typing.TYPE_CHECKING"}),
    ("def f():\n    import asyncio\n", {"asyncio"}),
])
def test_imported_names(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert imported_names("ppstate.mod", path) == expected
