"""Where the tests find the repository's files (tests/ is on sys.path: pytest puts conftest.py's folder there)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# The real-text corpus sits beside the checkout on CI and development machines (users pass their own path).
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare.txt"
