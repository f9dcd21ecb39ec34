"""Helpers of the JIT tests: the fake compiler (deterministic blobs, a log line per compile, optional delay or
failure), a C header's struct fields as declared, a CUDA source run as a host program (nvcc, `NVCC` /
`needs_nvcc`), and the GPU files' marks with the fixture that checks `ep_moe.permute` takes the JIT kernels
(`GPU_JIT_MARKS`, `jit_taken`: import both into a module)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ep_moe import permute
from ep_moe.native import jit
from ep_moe.native.jit.compilers import CompileError, find_nvcc

NVCC = find_nvcc()[0] if shutil.which("nvcc") else None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here")

GPU_JIT_MARKS = [pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
                 pytest.mark.skipif(jit.compiler()[0] is None, reason=f"no CUDA compiler: {jit.compiler()[1]}")]


@pytest.fixture(autouse=True)
def jit_taken():
    """For every test of the module that imports it: `ep_moe.permute` takes the JIT kernels."""
    assert permute.kernel_implementation(torch.empty(1, device="cuda")) == "jit", jit.unavailable_reason()


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


def header_fields(header: Path, struct: str) -> list[str]:
    """Field names of ``struct`` in the C header ``header``, in order (declarations ``type a, b;`` and
    ``type a[N];``)."""
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", header.read_text(), re.S)
    assert body, f"struct {struct} not found in {header.name}"
    names = []
    for line in body.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        assert code.endswith(";"), f"{struct}: cannot read the declaration {code!r}"
        declarators = re.sub(r"\[[^\]]*\]", "", code[:-1])  # array extents
        first, *rest = declarators.split(",")
        names.append(first.split()[-1].lstrip("*"))
        names += [d.strip().lstrip("*") for d in rest]
    return names


def host_program(nvcc: str, tmp_path: Path, source: str, name: str) -> list[int]:
    """Compile ``source`` as a host program with ``nvcc`` (sm_90), run it, and return the integers it prints."""
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    exe = tmp_path / name
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-o", str(exe), str(path)], check=True, capture_output=True,
                   timeout=600)
    return [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                                           timeout=60).stdout.split()]
