"""Package layout: the import graph of every module (imports inside functions
included) has no cycle, and no module imports from a layer above its own."""
import ast
from pathlib import Path

import networkx as nx

import flexflow as ff

PKG = Path(ff.__file__).parent

# Lowest first.  A module belongs to the layer of its first name under flexflow/
# (flexflow.sim.plans -> "sim"); flexflow/__init__.py is the top.
LAYERS = ["settings", "graph", "strategy", "hardware", "cost", "sim", "search", "runtime", "calibrate",
          "finalists", "native", "plan", "models", "launch", "api", "cli", "flexflow"]
RANK = {name: i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def _targets(path: Path, mod: str, mods) -> set[str]:
    """The modules of the package that ``path`` imports, at any depth of its code
    (``from pkg import name`` counts as importing ``pkg.name`` when that is a module)."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
            else:
                base = n.module or ""
            if base != "flexflow" and not base.startswith("flexflow."):
                continue
            for a in n.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name == "flexflow" or a.name.startswith("flexflow.")}
    return out


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for mod, path in mods.items():
        g.add_node(mod)
        for t in _targets(path, mod, mods):
            while t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            if t != mod:
                g.add_edge(mod, t)
    return g


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_module_has_a_layer():
    assert {_layer(m) for m in _modules()} <= set(LAYERS), sorted({_layer(m) for m in _modules()} - set(LAYERS))


def test_no_import_cycle():
    g = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, cycles


def test_no_import_goes_to_a_higher_layer():
    up = [(a, b) for a, b in _graph().edges if RANK[_layer(b)] > RANK[_layer(a)]]
    assert not up, sorted(up)


def test_nothing_below_the_runtime_imports_torch_distributed():
    low = {m for m in _modules() if RANK[_layer(m)] < RANK["runtime"]}
    bad = []
    for mod, path in _modules().items():
        if mod not in low:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import)
                     else [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            bad += [(mod, x) for x in names if x.startswith("torch.distributed")]
    assert not bad, bad


def test_the_checks_see_function_level_imports(tmp_path):
    # the graph builder must see an import inside a function body, the kind a cycle hides in
    mods = _modules()
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from .sim import simulate\n    from ..strategy.config import ParallelConfig\n")
    assert _targets(f, "flexflow.calibrate.m", mods) >= {"flexflow.calibrate.sim", "flexflow.strategy.config"}
    f.write_text("def f():\n    from flexflow.sim import simulate\n")
    assert _targets(f, "flexflow.graph.m", mods) == {"flexflow.sim.simulate"}


def test_no_module_is_too_long_to_read():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 560}
    assert not long, long


def test_search_package_keeps_its_names():
    import flexflow.search as pkg_or_fn  # the package's function shadows it on flexflow
    from flexflow.search import (BASELINES, SearchError, SearchResult, baseline_strategies,
                                 exhaustive_search, is_local_optimum, optcnn, optcnn_cost, search)
    from flexflow.search.mcmc import search as mcmc_search
    assert ff.search is search is mcmc_search and callable(pkg_or_fn)
    assert set(BASELINES) == {"data_parallel", "model_parallel", "expert", "optcnn"}
    assert issubclass(SearchError, ValueError) and SearchResult.__name__ == "SearchResult"
    assert all(map(callable, (baseline_strategies, exhaustive_search, is_local_optimum, optcnn, optcnn_cost)))


def test_public_names():
    import flexflow.launch  # noqa: F401 - importing the module must not unbind the function
    import flexflow.search.mcmc  # noqa: F401
    for name in ("ParallelModule", "CostModel", "StrategyError", "LaunchError", "parallelize", "launch",
                 "Machine", "Strategy", "ParallelConfig", "Simulator", "search", "trace"):
        assert getattr(ff, name) is not None, name
    assert callable(ff.launch) and callable(ff.search) and callable(ff.parallelize)
    assert isinstance(ff.ParallelModule, type) and issubclass(ff.LaunchError, RuntimeError)
    from flexflow.calibrate import calibrate, ensure_calibrated
    assert callable(calibrate) and callable(ensure_calibrated)
