"""The fake compiler of the JIT tests: deterministic blobs, a log line per compile, optional delay or failure."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from ep_moe.native.jit.compilers import CompileError


class FakeCompiler:
    """Writes ``FAKECUBIN`` + sha256(source, defines, flags, arch, version); appends a line to ``log`` per compile."""

    name = "fake"

    def __init__(self, version: str = "1.0", log: Path | None = None, delay_s: float = 0.0, fail: bool = False):
        self.identity = f"fake {version}"
        self.log, self.delay_s, self.fail = log, delay_s, fail

    def compile(self, source, include_dirs, defines, flags, arch) -> bytes:
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise CompileError(f"jit: {self.identity} could not compile {source}:\n{source}(3): error: fake failure")
        text = "|".join([source.read_text(), repr(tuple(defines)), repr(tuple(flags)), arch, self.identity])
        return b"FAKECUBIN" + hashlib.sha256(text.encode()).digest()

    def compiles(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log is not None and self.log.exists() else 0
