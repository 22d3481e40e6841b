"""The project's import graph, read from the source with `ast` (nothing is imported).

Every `import` / `from ... import` statement counts, at module level or inside a function,
except those under `if TYPE_CHECKING:`. `from pkg import name` is an edge to the module
`pkg.name` when that is a module, else to `pkg` itself (its `__init__` runs). Modules are
named as installed: the top-level folders sharding/, launch/, models/ and jobscripts/ are
`spmd.sharding`, `spmd.launch`, `spmd.models` and `spmd.jobscripts`.
"""

from __future__ import annotations

import ast
from pathlib import Path

FOLDERS = {"spmd": "spmd", "sharding": "spmd.sharding", "launch": "spmd.launch",
           "models": "spmd.models", "jobscripts": "spmd.jobscripts"}


def package_modules(repo: Path) -> dict[str, Path]:
    """Installed module name -> source file, for every module of the spmd package."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of `tree`, skipping the bodies of `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        found: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = name.split(".") if is_package else name.split(".")[:-1]
                    parent = parent[:len(parent) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.setdefault(target, node.lineno)
        edges[name] = found
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)
