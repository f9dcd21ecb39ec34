"""No docstring under ``ep_moe/`` is longer than `MAX_LINES` lines: the long explanation belongs in docs/*.md.

Every module, class and function (methods and nested ones included) of every ``.py`` file under ``ep_moe/`` is
read with `ast`; a docstring's length is the count of source lines its string literal spans, the quote lines
included. A failure names the file, the object and its line count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ep_moe"
MAX_LINES = 25

Scope = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _scopes_in(node: ast.AST) -> Iterator[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    """The classes and functions directly inside ``node`` (not inside another class or function of it)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield child
        else:
            yield from _scopes_in(child)


def docstring_lengths(source: str, filename: str = "<string>") -> Iterator[tuple[str, int, int]]:
    """Each docstring of ``source``: its object's dotted name (``<module>`` for the module), the line the
    docstring starts on, and the source lines it spans."""

    def visit(node: Scope, name: str) -> Iterator[tuple[str, int, int]]:
        first = node.body[0] if node.body else None
        literal = first.value if isinstance(first, ast.Expr) else None
        if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
            yield name, literal.lineno, literal.end_lineno - literal.lineno + 1
        for child in _scopes_in(node):
            yield from visit(child, child.name if isinstance(node, ast.Module) else f"{name}.{child.name}")

    yield from visit(ast.parse(source, filename), "<module>")


def long_docstrings(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """``"path: object (N lines, from line L)"`` for every docstring under ``root`` longer than ``max_lines``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for name, line, lines in docstring_lengths(path.read_text(encoding="utf-8"), str(path)):
            if lines > max_lines:
                found.append(f"{relative}: {name} ({lines} lines, from line {line})")
    return found


def test_no_docstring_over_the_limit() -> None:
    files = list(PACKAGE.rglob("*.py"))
    assert len(files) > 20, f"expected the package's modules under {PACKAGE}, found {len(files)} files"
    found = long_docstrings(PACKAGE)
    assert not found, (f"{len(found)} docstring(s) over {MAX_LINES} lines; move the explanation to the doc that "
                       "owns the topic (docs/*.md) and point to it:\n" + "\n".join(found))


def _docstring(lines: int, indent: str = "") -> str:
    """A docstring literal spanning ``lines`` source lines (``lines`` >= 2), its first line unindented."""
    middle = "".join(f"{indent}line {i}\n" for i in range(lines - 2))
    return f'"""Summary.\n{middle}{indent}"""'


@pytest.mark.parametrize("lines", [MAX_LINES, MAX_LINES + 1])
def test_the_limit_is_inclusive(tmp_path: Path, lines: int) -> None:
    source = f"def f():\n    {_docstring(lines, '    ')}\n"
    assert list(docstring_lengths(source)) == [("f", 2, lines)]
    (tmp_path / "m.py").write_text(source)
    expected = [] if lines <= MAX_LINES else [f"{tmp_path / 'm.py'}: f ({lines} lines, from line 2)"]
    assert long_docstrings(tmp_path) == expected


def test_every_kind_of_object_is_read(tmp_path: Path) -> None:
    source = "\n\n".join([
        _docstring(30),
        f"class A:\n    {_docstring(31, '    ')}",
        f"    def method(self):\n        {_docstring(32, '        ')}",
        f"        def inner():\n            {_docstring(33, '            ')}",
        f"async def g():\n    {_docstring(34, '    ')}",
        'def short():\n    """One line."""',
        f"x = 1\n{_docstring(40)}",  # a string after a statement is no docstring
    ]) + "\n"
    lines = source.splitlines()
    found = list(docstring_lengths(source))
    assert [(name, length) for name, _, length in found] == [
        ("<module>", 30), ("A", 31), ("A.method", 32), ("A.method.inner", 33), ("g", 34), ("short", 1)]
    assert all('"""' in lines[line - 1] for _, line, _ in found)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    reported = long_docstrings(tmp_path / "pkg")
    assert [entry.split(": ", 1)[1].split(" (")[0] for entry in reported] == [
        "<module>", "A", "A.method", "A.method.inner", "g"]
    assert all(entry.startswith(f"{tmp_path / 'pkg' / 'mod.py'}: ") for entry in reported)
