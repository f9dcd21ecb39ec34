"""The package's layers: no module imports a home above its own (the picture in docs/architecture.md).

Each top-level module or folder of ``ep_moe`` is one home with a level; a module may import its own home,
and homes of its level or below. Function-level imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import ep_moe

PACKAGE = Path(ep_moe.__file__).parent

# Bottom to top. `__init__` is the public API (it re-exports up to the dispatcher).
LEVELS = {
    "config": 0, "handle": 0, "event": 0, "validation": 0, "layout": 0, "reference": 0, "distributed": 0,
    "permute_triton": 0, "wire": 0,
    "native": 1, "memory": 1,
    "backends": 2, "permute": 2, "engram": 2, "hybrid": 2,
    "buffer": 3,
    "ops": 4, "tuning": 4, "expert_major": 4, "pipeline_comm": 4, "agrs": 4,
    "dispatcher": 5, "elastic": 5,
    "layers": 6, "__init__": 6,
    "compat": 7, "integrations": 7, "train": 7, "benchmarking": 7,
    "cli": 8,
    "__main__": 9,
}


def _home(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _imported_homes(path: Path) -> set[str]:
    """The ep_moe homes ``path`` imports (absolute or relative, at any depth of the code)."""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    homes = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "ep_moe":
                continue
            home = parts[1] if len(parts) > 1 else "__init__"
            if home not in LEVELS:  # a name imported from the package's __init__ (from ep_moe import Buffer)
                home = "__init__"
            homes.add(home)
    return homes


def test_every_home_has_a_level():
    homes = {_home(p) for p in PACKAGE.rglob("*.py")}
    assert homes <= set(LEVELS), f"give these a level: {sorted(homes - set(LEVELS))}"


def test_no_import_runs_up_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        home = _home(path)
        for target in _imported_homes(path) - {home}:
            if LEVELS[target] > LEVELS[home]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} ({home}, level {LEVELS[home]}) imports "
                              f"{target} (level {LEVELS[target]})")
    assert not upward, "\n".join(upward)
