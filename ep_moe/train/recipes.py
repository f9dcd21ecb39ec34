"""The recipes shipped with the package: where they are, their names, and a one-line description of each.

The repository's top-level ``recipes/`` folder is the one copy. An installed wheel carries it as package
data in ``ep_moe/recipes/`` (``setup.py`` maps the folder there); a source checkout or an editable install
reads the repository's folder. ``ep-moe train NAME`` runs the recipe ``NAME.yaml`` from there when ``NAME``
is not a file, and ``ep-moe recipes`` lists them.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # ep_moe/
SEARCH_DIRS = (_PACKAGE / "recipes", _PACKAGE.parent / "recipes")  # installed wheel, source checkout


def recipes_dir() -> Path | None:
    """The folder of the built-in recipes, or None when this installation has none."""
    for folder in SEARCH_DIRS:
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def builtin_recipes() -> dict[str, Path]:
    """``name -> path`` of every built-in recipe, by name."""
    folder = recipes_dir()
    return {} if folder is None else {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def describe(path: Path) -> str:
    """The recipe's one-line description: its first comment line, without ``# NAME:``."""
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    if not first.startswith("#"):
        return ""
    text = first.lstrip("#").strip()
    prefix = f"{path.stem}:"
    return text[len(prefix):].strip() if text.startswith(prefix) else text


def find_recipe(name_or_path: str) -> str | None:
    """A built-in recipe's path for ``NAME`` or ``NAME.yaml`` (no folder part), else None."""
    if "/" in name_or_path or "\\" in name_or_path:
        return None
    name = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    path = builtin_recipes().get(name)
    return None if path is None else str(path)


def listing() -> str:
    """What ``ep-moe recipes`` prints: one line per recipe (name, engine, description)."""
    import yaml

    recipes = builtin_recipes()
    if not recipes:
        return "no built-in recipes in this installation (looked in " + ", ".join(map(str, SEARCH_DIRS)) + ")"
    width = max(len(n) for n in recipes)
    lines = []
    for name, path in recipes.items():
        try:
            engine = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("engine", "ep_moe")
        except yaml.YAMLError:
            engine = "?"
        lines.append(f"{name:<{width}}  {engine:<9}  {describe(path)}")
    lines.append(f"(in {recipes_dir()}; run one with: ep-moe train NAME [KEY=VALUE ...], "
                 "print it with: ep-moe train NAME --print-config)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ep-moe recipes``."""
    import argparse

    argparse.ArgumentParser(prog="ep-moe recipes",
                            description="List the recipes shipped with ep_moe, one line each.").parse_args(argv)
    print(listing(), flush=True)
    return 0
