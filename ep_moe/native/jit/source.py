"""What a JIT kernel is made of: a source file, the headers it includes (found recursively from its
``#include "..."`` lines), and the specialization (preprocessor defines), with the digests that key the cache.

No CUDA, no torch: pure file reading and hashing (tested on CPU).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# ep_moe/native/kernels: every kernel source and header (thin entry files, the headers they include)
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
_DEFINE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Define = tuple[str, str]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class KernelSource:
    """One compile unit: ``file`` (a path, or a name under `KERNELS_DIR`) compiled with ``defines`` (the
    specialization: ``-DNAME=VALUE`` for each pair, sorted by name). One compile gives one module; a module holds
    every ``extern "C" __global__`` function of the file.

    Build with `KernelSource.of`, which checks the names and turns values into strings.
    """

    file: Path
    defines: tuple[Define, ...] = ()

    @classmethod
    def of(cls, file: str | Path, defines: Mapping[str, int | str | bool] | None = None) -> KernelSource:
        """``file`` relative to `KERNELS_DIR` unless absolute. Raises ``ValueError`` naming a define that is not
        a C identifier or whose value holds whitespace, and ``FileNotFoundError`` for a missing file."""
        path = Path(file)
        if not path.is_absolute():
            path = KERNELS_DIR / path
        if not path.is_file():
            raise FileNotFoundError(f"jit: kernel source {path} does not exist")
        pairs = []
        for name, value in sorted((defines or {}).items()):
            text = str(int(value)) if isinstance(value, bool) else str(value)
            if not _DEFINE_NAME.match(name):
                raise ValueError(f"jit: define {name!r} of {path.name} is not a C identifier")
            if not text or any(ch.isspace() for ch in text):
                raise ValueError(f"jit: define {name}={text!r} of {path.name} must be one non-empty token")
            pairs.append((name, text))
        return cls(path, tuple(pairs))

    @property
    def label(self) -> str:
        """``file.cu[NAME=VALUE,...]``: the human name of the specialization (reports, errors)."""
        return f"{self.file.name}[{','.join(f'{k}={v}' for k, v in self.defines)}]"


PACKAGE_NATIVE_DIR = KERNELS_DIR.parent  # ep_moe/native: the root of the kernel sources' key paths


def _key_path(header: Path, source: Path) -> str:
    """How ``header`` appears in a cache key: ``ep_moe/native/<path>`` for the package's own files (the same key
    wherever the package is installed, whichever folder the including source is in, e.g. the layout probe
    generated into the cache folder), else its path relative to ``source``'s folder."""
    try:
        return "ep_moe/native/" + header.relative_to(PACKAGE_NATIVE_DIR).as_posix()
    except ValueError:
        return Path(os.path.relpath(header, source.parent.resolve())).as_posix()


def included_headers(source: Path, include_dirs: Iterable[Path] = ()) -> dict[str, str]:
    """Every header ``source`` reaches through ``#include "..."`` (recursively), as ``{path: sha256}`` with the path
    as `_key_path` writes it (found next to the including file, else in the first include dir that has it).

    An include found nowhere (a toolkit header written with quotes) is left out: the compiler's identity stands
    for the toolkit's headers. Conditional includes count as included (a superset keys safely).
    """
    dirs = [Path(d) for d in include_dirs]
    found: dict[str, str] = {}
    seen: set[Path] = set()
    pending = [source]
    while pending:
        current = pending.pop()
        for name in _INCLUDE.findall(current.read_text(encoding="utf-8", errors="replace")):
            for base in [current.parent, *dirs]:
                candidate = (base / name).resolve()
                if candidate.is_file():
                    break
            else:
                continue
            if candidate in seen:
                continue
            seen.add(candidate)
            rel = _key_path(candidate, source)
            found[rel] = sha256_file(candidate)
            pending.append(candidate)
    return dict(sorted(found.items()))


__all__ = ["KERNELS_DIR", "KernelSource", "included_headers", "sha256_file"]
