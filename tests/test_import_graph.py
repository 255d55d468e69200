"""The layering (docs/ARCHITECTURE.md) as a test: kernels/ imports nothing of bole/ or deployments/,
bole/ imports neither deployments/ nor Ray, and the import graph of the three packages has no cycle.

Every import statement counts, at module level or inside a function (a deferred import still ties
the two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bole", "kernels", "deployments")

# Cycles allowed, each as its sorted module names: none. The list stays so a reviewer sees the rule.
KNOWN_CYCLES: list[tuple[str, ...]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, module: str, is_package: bool, modules=frozenset()) -> set[str]:
    """Every module name that ``module``'s source imports: ``from a import b`` names a.b when that is
    one of ``modules`` (a submodule), else a (b is a name defined in a)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                names.add(sub if sub in modules else target)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports: our modules by name, any other by its top-level name."""
    sources = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph = {}
    for mod, path in sources.items():
        names = imported_names(ast.parse(path.read_text(), str(path)), mod, path.name == "__init__.py", sources)
        edges = set()
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                edges.add(name.split(".")[0])
            elif name in sources and name != mod:
                edges.add(name)
        graph[mod] = edges
    return graph


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    """kernels -> bole / deployments, and bole -> deployments / ray."""
    rules = {"kernels": ("bole", "deployments"), "bole": ("deployments", "ray")}
    bad = []
    for mod, targets in sorted(graph.items()):
        banned = rules.get(mod.split(".")[0], ())
        bad += [f"{mod} -> {t}" for t in sorted(targets) if t.split(".")[0] in banned]
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its first module) per strongly connected component of size > 1
    (or a self-loop), found by Tarjan's algorithm."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                sccs.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [cycle_in(graph, comp) for comp in sccs]


def cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A path start -> ... -> start within the strongly connected ``comp`` (breadth first)."""
    start = min(comp)
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def test_checker_catches_a_synthetic_arrow_and_cycle():
    graph = {"kernels.a": {"bole.x", "torch"}, "bole.x": {"bole.y", "ray"}, "bole.y": {"bole.z"},
             "bole.z": {"bole.x"}, "deployments.d": {"bole.x"}}
    assert forbidden_arrows(graph) == ["bole.x -> ray", "kernels.a -> bole.x"]
    assert find_cycles(graph) == [["bole.x", "bole.y", "bole.z", "bole.x"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_from_imports_resolve():
    tree = ast.parse("from . import sampler\nfrom ..spec.tree import PackedForest\nimport torch.nn\n")
    names = imported_names(tree, "bole.engine.engine", is_package=False,
                           modules={"bole.engine.sampler", "bole.spec.tree"})
    assert names == {"bole.engine.sampler", "bole.spec.tree", "torch.nn"}
    # a name from a package's __init__ (not a submodule) is an arrow to the package
    assert imported_names(ast.parse("from bole import LLM\n"), "bole.x", False, {"bole.llm"}) == {"bole"}


def test_no_forbidden_imports():
    assert forbidden_arrows(import_graph()) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    unexpected = [c for c in cycles if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert unexpected == [], "import cycles: " + "; ".join(" -> ".join(c) for c in unexpected)
    stale = [c for c in KNOWN_CYCLES if c not in [tuple(sorted(set(c))) for c in cycles]]
    assert stale == [], f"KNOWN_CYCLES lists cycles that no longer exist: {stale}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_package_is_parsed(pkg):
    assert any(m.split(".")[0] == pkg for m in import_graph())
