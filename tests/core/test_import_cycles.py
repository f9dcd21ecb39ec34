"""No import cycle between the files of ``ep_moe``: the import graph (function-level imports included) has no
strongly connected component of more than one module."""

from __future__ import annotations

from pathlib import Path

from support_imports import find_cycles, import_graph


def test_no_import_cycle_between_files():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_a_planted_cycle_is_found_and_named(tmp_path: Path):
    package = tmp_path / "ep_moe"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .inner import b\n")
    (package / "inner" / "b.py").write_text("def f():\n    from ep_moe.c import C\n    return C\n")
    (package / "c.py").write_text("from ep_moe.a import b\n\nC = 1\n")
    (package / "leaf.py").write_text("from . import c\n")

    graph = import_graph(package)
    assert graph["ep_moe.leaf"] == {"ep_moe.c"}
    assert find_cycles(graph) == [["ep_moe.a", "ep_moe.inner.b", "ep_moe.c", "ep_moe.a"]]


def test_a_module_importing_a_name_of_its_package_init_is_a_cycle(tmp_path: Path):
    package = tmp_path / "ep_moe"
    package.mkdir()
    (package / "__init__.py").write_text("from .x import X\n")
    (package / "x.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ep_moe import X\n")
    assert find_cycles(import_graph(package)) == [["ep_moe", "ep_moe.x", "ep_moe"]]
