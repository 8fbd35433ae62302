"""The import graph: core imports nothing above it, and no module imports itself back.

Every import counts, function-level ones included (a lazy import hides a cycle, it does
not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in (ROOT / "kvserve").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            graph[module] |= {n for n in names if n in modules and n != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_core_imports_nothing_above_it():
    graph = import_graph()
    assert graph["kvserve.config"] == set()
    assert graph["kvserve.sampling_params"] == set()
    assert graph["kvserve.request"] == {"kvserve.sampling_params"}


def test_no_import_cycles():
    assert cycles(import_graph()) == []


# Each package's floor (docs/design.md's diagram): a module imports only from packages on
# lower floors, or from its own package.
FLOORS = [
    ["kvserve.config", "kvserve.sampling_params", "kvserve.cache_control", "kvserve.extensions"],
    ["kvserve.request"],
    ["kvserve.offload"],
    ["kvserve.kv"],
    ["kvserve.attention", "kvserve.sampling", "kvserve.scheduler"],
    ["kvserve.model"],
    ["kvserve.blend", "kvserve.plan", "kvserve.options", "kvserve.speculative"],
    ["kvserve.engine"],
    ["kvserve.llm"],
    ["kvserve", "kvserve.server"],
    ["kvserve.cluster", "kvserve.bench"],
    ["kvserve.eval"],
    ["kvserve.cli"],
]


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_nothing_imports_upwards():
    floor = {package: i for i, packages in enumerate(FLOORS) for package in packages}
    graph = import_graph()
    assert {package_of(m) for m in graph} == floor.keys()      # every package has its floor
    upwards = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                     if package_of(a) != package_of(b) and floor[package_of(b)] >= floor[package_of(a)])
    assert upwards == []
