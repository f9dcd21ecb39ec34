"""Every name the documentation gives exists: README.md and docs/*.md against the code.

Checked, per document and line:

- a code span (`...`) naming a dotted path under ``ep_moe`` (``ep_moe.buffer.routing_layout.summation_order``) resolves by
  import + getattr, or is a key of the recipe's ``ep_moe`` section (``ep_moe.num_sms``);
- every ``EP_MOE_*`` environment variable named occurs in the code (``ep_moe/``, ``benchmarks/``, ``tests/``,
  ``setup.py``); ``EP_MOE_NATIVE_<FIELD>`` names a field of `ep_moe.NativeOptions`;
- every ``ep-moe <subcommand>`` (also ``-m ep_moe.cli <subcommand>``) in a code span or a fenced block names a
  subcommand, and every ``--option`` after it exists in that subcommand's argparse parser (the parser is built,
  not grepped);
- every repository path in a code span or a fenced block (``tests/...``, ``benchmarks/...``, ``docs/...``,
  ``recipes/...``, ``ep_moe/...``) exists; ``path::name`` also names a function or class in that file.

A failure names the document, the line and the span.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (document, span) pairs allowed to fail while a document is being rewritten: none now.
PENDING: set[tuple[str, str]] = set()

CODE_DIRS = ("ep_moe", "benchmarks", "tests")
CODE_FILES = ("setup.py",)

SPAN = re.compile(r"(`+)(.+?)\1")
DOTTED = re.compile(r"(?<![\w.])ep_moe(?:\.[A-Za-z_]\w*)+")
ENV = re.compile(r"\bEP_MOE_[A-Z0-9_]*")
COMMAND = re.compile(r"(?:(?<![\w.-])ep-moe|-m\s+ep_moe\.cli)((?:\s+\S+)*)")
PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|docs|recipes|ep_moe)/[\w./*<>-]*[\w*>](?:::\w+)?)")
SHELL_END = {"|", "||", "&&", ";", "#", ">", "2>&1", "&"}


@dataclasses.dataclass(frozen=True)
class Ref:
    """One piece of code text of a document: the document (relative to the repository), its line, the text, and
    whether it is a code span (False: a line of a fenced block)."""

    doc: str
    line: int
    text: str
    span: bool


def code_refs(doc: str, text: str) -> Iterator[Ref]:
    """The code spans of ``text`` (outside fenced blocks) and the lines of its fenced blocks, a fenced line ending
    in a backslash joined with the next."""
    fenced, pieces, start = False, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            if not pieces:
                start = number
            pieces.append(line.strip().removesuffix("\\").strip())
            if not line.rstrip().endswith("\\"):
                yield Ref(doc, start, " ".join(pieces), False)
                pieces = []
        else:
            for match in SPAN.finditer(line):
                yield Ref(doc, number, match.group(2).strip(), True)


def resolve_dotted(name: str) -> str | None:
    """None when ``name`` is a module, or an attribute path of one, or a key of the recipe's ``ep_moe`` section;
    else why not."""
    parts = name.split(".")
    error = "no such module"
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as exc:
            error = f"import failed: {exc}"
            continue
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                error = f"{'.'.join(parts[:i])} has no attribute {attr!r}"
                break
            obj = getattr(obj, attr)
        else:
            return None
        break
    from ep_moe.train.recipe_schema import EpMoeSection

    if len(parts) == 2 and parts[1] in {f.name for f in dataclasses.fields(EpMoeSection)}:
        return None
    return error


def _code_text() -> str:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".cu", ".h", ".cpp")]
    files += [ROOT / f for f in CODE_FILES]
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file() and p.name != Path(__file__).name)


def check_env(name: str, code: str) -> str | None:
    """None when the variable (or the prefix, for a name that ends in ``_``) occurs in ``code``; an
    ``EP_MOE_NATIVE_<FIELD>`` variable must name a field of `ep_moe.NativeOptions`."""
    from ep_moe.config import NativeOptions

    prefix = "EP_MOE_NATIVE_"
    if name.startswith(prefix) and name != prefix:
        fields = {f.name for f in dataclasses.fields(NativeOptions)}
        return None if name[len(prefix):].lower() in fields else "names no field of ep_moe.NativeOptions"
    pattern = re.escape(name) if name.endswith("_") else rf"\b{re.escape(name)}\b"
    return None if re.search(pattern, code) else "occurs nowhere in the code"


def _capture_parser(module_name: str) -> argparse.ArgumentParser:
    """The parser a subcommand's ``main`` builds: its ``parse_args`` is stopped before anything runs."""

    class Built(Exception):
        pass

    module = importlib.import_module(module_name)
    original = argparse.ArgumentParser.parse_args

    def stop(self, *args, **kwargs):
        raise Built(self)

    argparse.ArgumentParser.parse_args = stop
    try:
        module.main(["--help"])
    except Built as built:
        return built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{module_name}.main built no argparse parser")


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every ``ep-moe`` subcommand's parser, built by the code the command runs."""
    from ep_moe.cli import COMMANDS
    from ep_moe.train.launch import _parser as train_parser

    parsers = {}
    for name, (module_name, _) in COMMANDS.items():
        parsers[name] = train_parser() if name == "train" else _capture_parser(module_name)
    return parsers


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def check_command(words: list[str], parsers: dict[str, argparse.ArgumentParser]) -> str | None:
    """None when ``words`` (what follows ``ep-moe``) name a subcommand and options it has; else why not."""
    words = [w.strip("[](),.:;'\"") for w in words]
    words = [w for w in words if w]
    if not words or not re.fullmatch(r"-{0,2}[a-z][\w-]*", words[0]) or words[0] in {"-", "--"}:
        return None
    head, rest = words[0], words[1:]
    if head.startswith("-"):
        return None if head in ("--version", "-V", "--help", "-h") else f"ep-moe has no option {head}"
    if head not in parsers:
        return f"no subcommand {head!r}"
    parser, where = parsers[head], f"ep-moe {head}"
    if rest and _subparsers(parser) and not rest[0].startswith("-"):
        if rest[0] not in _subparsers(parser):
            return f"{where} has no subcommand {rest[0]!r}"
        parser, where, rest = _subparsers(parser)[rest[0]], f"{where} {rest[0]}", rest[1:]
    known = _options(parser)
    for word in rest:
        if word in SHELL_END or word.startswith(("#", "2>", ">")):
            break
        option = word.split("=", 1)[0]
        if option.startswith("--") and len(option) > 2 and option not in known:
            return f"{where} has no option {option}"
    return None


def _command_words(text: str) -> Iterator[list[str]]:
    for match in COMMAND.finditer(text):
        words = match.group(1).split()
        for i, word in enumerate(words):  # the command ends where the shell's next one starts
            if word in SHELL_END or word.startswith("#"):
                words = words[:i]
                break
        yield words


def check_path(path: str) -> str | None:
    """None when the repository has ``path`` (and, for ``path::name``, a function or class ``name`` in it)."""
    file, _, name = path.partition("::")
    target = ROOT / file
    if not target.exists():
        return "no such file or folder in the repository"
    if name and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", target.read_text(), re.M):
        return f"{file} defines no {name}"
    return None


def problems(docs: list[tuple[str, str]], code: str | None = None,
             parsers: dict[str, argparse.ArgumentParser] | None = None) -> dict[str, list[str]]:
    """Every failing reference of ``docs`` (pairs of name and text) by kind: ``dotted``, ``env``, ``command``,
    ``path``; each as ``doc:line: `span`: why``, unless it is in `PENDING`."""
    code = _code_text() if code is None else code
    parsers = subcommand_parsers() if parsers is None else parsers
    found: dict[str, list[str]] = {"dotted": [], "env": [], "command": [], "path": []}

    def fail(kind: str, doc: str, line: int, span: str, why: str) -> None:
        if (doc, span) not in PENDING:
            found[kind].append(f"{doc}:{line}: `{span}`: {why}")

    for doc, text in docs:
        for number, line in enumerate(text.splitlines(), 1):
            for name in sorted(set(ENV.findall(line))):
                if (why := check_env(name, code)) is not None:
                    fail("env", doc, number, name, why)
        for ref in code_refs(doc, text):
            if ref.span:
                for name in DOTTED.findall(ref.text):
                    if (why := resolve_dotted(name)) is not None:
                        fail("dotted", doc, ref.line, ref.text, f"{name}: {why}")
            for words in _command_words(ref.text):
                if (why := check_command(words, parsers)) is not None:
                    fail("command", doc, ref.line, ref.text, why)
            for path in PATH.findall(ref.text):
                if "*" not in path and "<" not in path and (why := check_path(path.rstrip("."))) is not None:
                    fail("path", doc, ref.line, ref.text, f"{path}: {why}")
    return found


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    return problems([(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS])


@pytest.mark.parametrize("kind", ["dotted", "env", "command", "path"])
def test_docs_name_what_exists(found: dict[str, list[str]], kind: str) -> None:
    assert not found[kind], f"{len(found[kind])} {kind} reference(s) name nothing that exists:\n" + "\n".join(
        found[kind])


def test_pending_entries_still_fail(found: dict[str, list[str]]) -> None:
    """Every pending pair still names a span of its document (an entry fixed or gone must leave the list)."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS}
    stale = [(doc, span) for doc, span in PENDING if span not in texts.get(doc, "")]
    assert not stale, f"pending entries no document holds any more: {stale}"


def test_planted_wrong_names_are_reported() -> None:
    """The checks fail, naming the document, line and span, on wrong names of every kind."""
    doc = "\n".join([
        "Fine: `ep_moe.buffer.routing_layout.summation_order`, `ep_moe.num_sms`, `EP_MOE_CACHE_DIR`, `ep-moe bench --tokens 8`.",
        "`ep_moe.buffer.routing_layout.no_such_function` and `ep_moe.no_such_module.x`",
        "Set `EP_MOE_NO_SUCH_VARIABLE=1` or EP_MOE_NATIVE_NO_SUCH_FIELD.",
        "```bash",
        "ep-moe bench --tokens 8 \\",
        "    --no-such-option 3",
        "```",
        "`ep-moe no-such-command`, `ep-moe jit warmup --no-such-flag`",
        "See `tests/core/no_such_test.py` and `tests/core/test_dispatch.py::no_such_test`.",
    ])
    found = problems([("planted.md", doc)])
    assert found["dotted"] == [
        "planted.md:2: `ep_moe.buffer.routing_layout.no_such_function`: ep_moe.buffer.routing_layout.no_such_function: ep_moe.buffer.routing_layout has no "
        "attribute 'no_such_function'",
        "planted.md:2: `ep_moe.no_such_module.x`: ep_moe.no_such_module.x: ep_moe has no attribute "
        "'no_such_module'"]
    assert found["env"] == ["planted.md:3: `EP_MOE_NATIVE_NO_SUCH_FIELD`: names no field of ep_moe.NativeOptions",
                            "planted.md:3: `EP_MOE_NO_SUCH_VARIABLE`: occurs nowhere in the code"]
    assert found["command"] == [
        "planted.md:5: `ep-moe bench --tokens 8 --no-such-option 3`: ep-moe bench has no option --no-such-option",
        "planted.md:8: `ep-moe no-such-command`: no subcommand 'no-such-command'",
        "planted.md:8: `ep-moe jit warmup --no-such-flag`: ep-moe jit warmup has no option --no-such-flag"]
    assert found["path"] == [
        "planted.md:9: `tests/core/no_such_test.py`: tests/core/no_such_test.py: no such file or folder in the "
        "repository",
        "planted.md:9: `tests/core/test_dispatch.py::no_such_test`: tests/core/test_dispatch.py::no_such_test: "
        "tests/core/test_dispatch.py defines no no_such_test"]
