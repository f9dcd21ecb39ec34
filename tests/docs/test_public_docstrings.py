"""Every public name of `ep_moe` (``ep_moe.__all__``) and every public method of those classes is documented.

Checked for each function, class, method, static method, class method and property (methods defined in ``ep_moe``,
in the class or a base class of the package; inherited ones from torch or Python are not ours):

- a docstring exists and its first line is a one-line summary sentence (it starts with a capital letter or a code
  span, ends with a period, and a blank line or the end follows it);
- ``Args:`` appears when the signature has parameters besides ``self`` / ``cls`` (a class: its constructor's), and
  every such parameter is named in the docstring (a ``*args``-only signature, a property and a parameter with a
  leading underscore are exempt);
- ``Returns:`` appears for a function or method whose return annotation is not None; one without an annotation
  needs it too unless its name starts with ``set_``, ``destroy`` or ``barrier`` (classes and properties are
  exempt: their docstring says what they hold).

A failure names the object and what its docstring lacks.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator

import pytest

import ep_moe

SUMMARY = re.compile(r"^[A-Z`].*\.$")
NO_RETURNS_PREFIXES = ("set_", "destroy", "barrier")


def public_objects() -> Iterator[tuple[str, object, str]]:
    """``(dotted name, object, kind)`` for each name of ``ep_moe.__all__`` and each public method of its classes
    defined in ``ep_moe``; kind is ``"class"``, ``"function"`` or ``"property"``."""
    for name in ep_moe.__all__:
        obj = getattr(ep_moe, name)
        if not inspect.isclass(obj):
            yield name, obj, "function"
            continue
        yield name, obj, "class"
        seen: set[str] = set()
        for klass in obj.__mro__:
            if not klass.__module__.startswith("ep_moe."):
                continue
            for attr, raw in vars(klass).items():
                if attr.startswith("_") or attr in seen:
                    continue
                seen.add(attr)
                if isinstance(raw, property):
                    yield f"{name}.{attr}", raw, "property"
                elif isinstance(raw, staticmethod | classmethod) or inspect.isfunction(raw):
                    yield f"{name}.{attr}", getattr(obj, attr), "function"


def _parameters(obj: object, kind: str) -> list[inspect.Parameter]:
    """The parameters a caller passes (no ``self`` / ``cls``; a class: its constructor's)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    params = list(signature.parameters.values())
    if kind == "function" and params and params[0].name in ("self", "cls") and not inspect.ismethod(obj):
        params = params[1:]
    return params


def _needs_returns(obj: object, name: str) -> bool:
    annotation = inspect.signature(obj).return_annotation
    if annotation is inspect.Signature.empty:
        return not name.rsplit(".", 1)[-1].startswith(NO_RETURNS_PREFIXES)
    return annotation not in (None, "None", type(None))


def docstring_problems(name: str, obj: object, kind: str) -> list[str]:
    """What ``obj``'s docstring lacks, as ``"NAME: ..."`` lines (empty when nothing)."""
    raw = obj.__doc__ if kind != "property" else obj.fget.__doc__
    if kind == "class" and raw is not None and raw.startswith(f"{obj.__name__}("):
        raw = None  # the constructor signature a NamedTuple or dataclass writes when the class has no docstring
    if not raw or not raw.strip():
        return [f"{name}: no docstring"]
    doc = inspect.cleandoc(raw)
    lines = doc.splitlines()
    found = []
    if not SUMMARY.match(lines[0]) or (len(lines) > 1 and lines[1].strip()):
        found.append(f"{name}: the first line is not a one-line summary sentence: {lines[0]!r}")
    if kind == "property":
        return found
    params = [p for p in _parameters(obj, kind) if not p.name.startswith("_")
              and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if params:
        if "Args:" not in doc:
            found.append(f"{name}: no 'Args:' section (parameters {[p.name for p in params]})")
        unnamed = [p.name for p in params if not re.search(rf"(?<![\w]){re.escape(p.name)}(?![\w])", doc)]
        if unnamed:
            found.append(f"{name}: parameters not named in the docstring: {unnamed}")
    if kind == "function" and _needs_returns(obj, name) and "Returns:" not in doc:
        found.append(f"{name}: no 'Returns:' section")
    return found


def test_the_public_surface_is_found() -> None:
    names = [name for name, _, _ in public_objects()]
    for expected in ("Buffer", "Buffer.dispatch", "Buffer.get_dispatch_config", "Buffer.backend_name",
                     "ElasticBuffer.combine", "ElasticBuffer.engram_fetch", "ElasticHandle.recv_src_metadata",
                     "DispatchHandle.num_recv_rows", "EventOverlap.current_stream_wait", "MoELayer.forward",
                     "TokenDispatcher.combine", "dispatch", "expert_cached_dispatch"):
        assert expected in names
    assert "MoELayer.train" not in names  # torch's, not ours
    assert len(names) > 60


@pytest.mark.parametrize("name,obj,kind", list(public_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_docstring(name: str, obj: object, kind: str) -> None:
    problems = docstring_problems(name, obj, kind)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ the checker itself
def _documented(x: int, y: int = 0) -> int:
    """Add two numbers.

    Args:
        x: the first.
        y: the second.

    Returns:
        Their sum.
    """
    return x + y


def _without_returns(x: int) -> int:
    """Add one.

    Args:
        x: the number.
    """
    return x + 1


def _without_args(x: int) -> None:
    """Print a number: x."""
    print(x)


def _unnamed_argument(x: int, y: int) -> None:
    """Print two numbers.

    Args:
        x: the first.
    """
    print(x, y)


def _two_line_summary() -> None:
    """Do nothing at all, and say so over
    two lines."""


def _no_annotation(x):
    """Return x.

    Args:
        x: anything.
    """
    return x


def _set_thing(x):
    """Set a thing.

    Args:
        x: the thing.
    """


def _star_args(*args) -> None:
    """Take anything."""


class _Holder:
    """Hold a value.

    Args:
        value: what is held.
    """

    def __init__(self, value: int) -> None:
        self.value = value

    @property
    def doubled(self) -> int:
        """Twice the value."""
        return 2 * self.value

    def get(self):
        """The value."""
        return self.value


@pytest.mark.parametrize("obj,kind,expected", [
    (_documented, "function", []),
    (_without_returns, "function", ["no 'Returns:' section"]),
    (_without_args, "function", ["no 'Args:' section"]),
    (_unnamed_argument, "function", ["parameters not named in the docstring: ['y']"]),
    (_two_line_summary, "function", ["the first line is not a one-line summary sentence"]),
    (_no_annotation, "function", ["no 'Returns:' section"]),
    (_set_thing, "function", []),
    (_star_args, "function", []),
    (_Holder, "class", []),
    (_Holder.doubled, "property", []),
    (_Holder.get, "function", ["no 'Returns:' section"]),
])
def test_the_checker_finds_what_is_missing(obj: object, kind: str, expected: list[str]) -> None:
    name = (obj.fget if kind == "property" else obj).__name__.lstrip("_")
    problems = docstring_problems(name, obj, kind)
    assert len(problems) == len(expected), problems
    for problem, part in zip(problems, expected):
        assert part in problem


def test_a_missing_docstring_and_a_generated_one_are_found() -> None:
    def bare(x: int) -> int:
        return x

    from typing import NamedTuple

    class Pair(NamedTuple):
        a: int
        b: int

    assert docstring_problems("bare", bare, "function") == ["bare: no docstring"]
    assert docstring_problems("Pair", Pair, "class") == ["Pair: no docstring"]
