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


# What an owner keeps private stays private: no module reads or writes, through another object
# than ``self`` or ``cls``, a one-underscore name that only other kvserve modules define (a class
# reading the same-named state of another of its instances is its own business; other libraries'
# private names are theirs to keep). A caller that needs something asks the owner, by a verb.
def private_names(tree: ast.AST) -> set[str]:
    """The one-underscore names a module defines: functions, classes, assignments, ``self._x``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads() -> list[str]:
    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "kvserve").rglob("*.py"))}
    defined = {path: private_names(tree) for path, tree in trees.items()}
    owned = set().union(*defined.values())
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in owned or node.attr in defined[path]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_no_module_reads_another_owners_private_names():
    assert private_reads() == []
