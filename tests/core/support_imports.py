"""The import graph of the ``ep_moe`` package, read from the source (no module is imported).

A node is a module's dotted name (``ep_moe.buffer.buffer_v1``; a package is its ``__init__``). An edge ``a -> b``
is an ``import`` or ``from ... import`` in ``a`` at any depth of the code (function-level imports and
``TYPE_CHECKING`` blocks included), absolute or relative, that names module ``b`` or a name defined in ``b``
(``from ep_moe.buffer import buffer_v1`` is an edge to ``ep_moe.buffer.buffer_v1``; ``from ep_moe import Buffer`` an
edge to ``ep_moe``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ep_moe

PACKAGE = Path(ep_moe.__file__).parent


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``ep_moe/buffer/__init__.py`` -> ``ep_moe.buffer``; ``ep_moe/buffer/buffer_v1.py`` -> ``ep_moe.buffer.buffer_v1``
    (``root``: the package's folder)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported_modules(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The modules of ``modules`` that ``path`` (a file of the package in ``root``) imports (see the module
    docstring)."""
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a name defined in a module: the module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` over every module under ``root`` (self-imports left out)."""
    files = package_files(root)
    return {name: imported_modules(path, set(files), root) - {name} for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module: ``[a, b, ..., a]``, each step an edge."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package's depth keeps the recursion shallow
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(c), graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A closed path through ``component`` (a strongly connected set) from its first module back to it."""
    start, members = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, so the cycle shown is a shortest one through ``start``
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")
