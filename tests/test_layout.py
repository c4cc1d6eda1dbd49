"""Package layout: no import cycles between modules; the search package keeps its names."""
import ast
from pathlib import Path

import flexflow as ff

PKG = Path(ff.__file__).parent


def _imports(path: Path, mod: str) -> set[str]:
    """Modules of flexflow that ``path`` imports, at module level or inside functions."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.level:
            base = pkg.split(".")[:len(pkg.split(".")) - (n.level - 1)]
            out.add(".".join(base + ([n.module] if n.module else [])))
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("flexflow"):
            out.add(n.module)
    return out


def test_no_import_cycles_between_modules():
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if not name.startswith("flexflow.ops"):
            mods[name] = path

    def norm(t):
        while t not in mods and "." in t:
            t = t.rsplit(".", 1)[0]
        return t
    graph = {m: {norm(t) for t in _imports(p, m)} - {m} for m, p in mods.items()}
    cycles = []
    for a, deps in graph.items():
        for b in deps:
            if a in graph.get(b, ()) and not (a.startswith(b + ".") or b.startswith(a + ".")):
                cycles.append(tuple(sorted((a, b))))
    assert not cycles, sorted(set(cycles))


def test_search_package_keeps_its_names():
    import flexflow.search as pkg_or_fn  # the package's function shadows it on flexflow
    from flexflow.search import (BASELINES, SearchError, SearchResult, baseline_strategies,
                                 exhaustive_search, is_local_optimum, optcnn, optcnn_cost, search)
    from flexflow.search.mcmc import search as mcmc_search
    assert ff.search is search is mcmc_search and callable(pkg_or_fn)
    assert set(BASELINES) == {"data_parallel", "model_parallel", "expert", "optcnn"}
    assert issubclass(SearchError, ValueError) and SearchResult.__name__ == "SearchResult"
    assert all(map(callable, (baseline_strategies, exhaustive_search, is_local_optimum, optcnn, optcnn_cost)))
