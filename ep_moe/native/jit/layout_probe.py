"""The check that the ctypes mirrors of `ep_moe.native.jit.params` equal what the compiler sees, shared by the
intranode kernels (`ep_moe.native.jit.intranode`) and the generic expert-major ops
(`ep_moe.native.jit.expert_major_exchange`): the probe source written to the cache, the read-back of a probe kernel's
words, and the error raised when they differ."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from . import params as P
from . import process_cache
from .driver import Function
from .launch_args import raw_stream


class JitLayoutError(RuntimeError):
    """The ctypes mirrors or constants of `ep_moe.native.jit.params` differ from what the compiler sees in the
    CUDA sources (a field was added to ``kernels.h`` but not to the mirror): nothing is launched."""


def probe_file(directory: Path | None = None, text: str | None = None) -> Path:
    """`params.probe_source` (or ``text``, another probe) written (once, content-addressed) under ``<cache>/src`` (a
    temporary folder where that cannot be written): what `ep-moe jit warmup` and the first use compile."""
    text = P.probe_source() if text is None else text
    name = f"params_layout-{hashlib.sha256(text.encode()).hexdigest()[:16]}.cu"
    if directory is not None:
        return _write_once(Path(directory) / name, text)
    try:
        return _write_once(process_cache().directory / "src" / name, text)
    except OSError:
        return _write_once(Path(tempfile.gettempdir()) / "ep_moe_jit_src" / name, text)


def _write_once(path: Path, text: str) -> Path:
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-", suffix=".cu")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a concurrent process reads the old or the new whole file
    return path


def read_back(fn: Function, count: int, device: int) -> list[int]:
    """Launch ``fn`` (one block of 32 threads writing ``count`` int64 words) on ``device`` and return the words."""
    out = torch.zeros(count, dtype=torch.int64, device=f"cuda:{device}")
    fn.launch(1, 32, raw_stream(device), out.data_ptr())
    return out.tolist()  # synchronizes


__all__ = ["JitLayoutError", "probe_file", "read_back"]
