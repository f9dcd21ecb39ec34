"""``python -m ep_moe.native``: what the native kernels need and whether they can run here.

One ``name: value`` line per item (`ITEMS`): the Python interpreter, torch, CUDA and the GPUs, NCCL, the symmetric
memory (the provider ``EP_MOE_SYMMETRIC_MEMORY`` names, and whether it can serve here), the JIT kernels (whether
they run, and why not), the intranode kernels (whether the native backend has them), the compiler found, the cache
directory and its kernels, and the multicast variables. ``ep-moe env`` (`ep_moe.cli.env`) prints
these and the rest of the installation. An item that cannot be found out says why instead.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import native
from ..distributed import MULTICAST_OFF, nccl_version
from ..elastic.memory.cuda_vmm import vmm_unavailable_reason
from . import jit

Item = tuple[str, Callable[[], str]]


def _cuda() -> str:
    if torch.cuda.is_available():
        return f"available (torch built for CUDA {torch.version.cuda})"
    if torch.version.cuda is None:
        return f"not available (torch {torch.__version__} is a CPU build)"
    return f"not available (torch built for CUDA {torch.version.cuda}, but no GPU is visible)"


def _gpus() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(count)]
    return f"{count}" + (f" ({', '.join(names)})" if names else "")


def _nccl() -> str:
    if not torch.cuda.is_available():
        return "not used (no CUDA)"
    return nccl_version() or "not in this torch"


def _symmetric_memory() -> str:
    provider = native.symmetric_memory_provider()
    chosen = f"{provider} ({native.SYMMETRIC_MEMORY_ENV}={os.environ.get(native.SYMMETRIC_MEMORY_ENV) or '(unset)'})"
    if provider == "vmm":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        reason = vmm_unavailable_reason(device, exportable=True, host=False)
        usable = f"usable on {device}" if reason is None else f"unavailable: {reason}"
        return f"{chosen}: CUDA VMM device memory shared by file descriptor (ranks may share a GPU), {usable}"
    try:  # (an import statement would make `torch` a local name of this function)
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as exc:  # any failure means the native backend cannot run
        return f"{chosen}: torch.distributed._symmetric_memory does not import ({type(exc).__name__}: {exc})"
    if provider == "nccl":
        return (f"{chosen}: torch.distributed._symmetric_memory on its NCCL backend (NCCL window registration, "
                "NCCL >= 2.27; checked at the first native Buffer)")
    return f"{chosen}: torch.distributed._symmetric_memory imports"


def _jit_kernels() -> str:
    reason = jit.unavailable_reason()
    if reason is not None:
        return f"unavailable ({reason})"
    compiler, _ = jit.compiler()
    how = "compiled on first use" if compiler is not None else "loaded from the cache only (no compiler)"
    return f"available: {how}, launched from Python (ep_moe.native.jit)"


def _intranode_kernels() -> str:
    reason = native.kernels_unavailable_reason()
    if reason is not None:
        return f"unavailable, and so is the native backend ({reason})"
    return "available: JIT kernels, one build per architecture (ep_moe.native.jit.intranode)"


def _jit_compiler() -> str:
    compiler, why = jit.compiler()
    return f"{compiler.identity} ({why})" if compiler is not None else f"none ({why})"


def _jit_cache() -> str:
    store = jit.process_cache()
    lines = store.describe()
    return f"{store.directory} ({len(lines)} kernels)" + "".join(f"\n    {line}" for line in lines)


def _multicast() -> str:
    return " ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in MULTICAST_OFF)


ITEMS: tuple[Item, ...] = (
    ("python", lambda: f"{sys.executable} ({platform.python_version()}, prefix {sys.prefix})"),
    ("torch", lambda: f"{torch.__version__} from {Path(torch.__file__).parent}"),
    ("CUDA", _cuda),
    ("GPUs", _gpus),
    ("NCCL", _nccl),
    ("symmetric memory", _symmetric_memory),
    ("JIT kernels", _jit_kernels),
    ("intranode kernels", _intranode_kernels),
    ("JIT compiler", _jit_compiler),
    ("JIT cache", _jit_cache),
    ("multicast", _multicast),
)


def format_report(items: Sequence[Item]) -> str:
    """One ``name: value`` line per item (a value may continue on indented lines); an item whose probe raises
    says so instead of stopping the report."""
    lines = []
    for name, probe in items:
        try:
            value = probe()
        except Exception as exc:  # one broken probe must not hide the rest of the report
            value = f"could not be determined ({type(exc).__name__}: {exc})"
        lines.append(f"{name + ':':<19}{value}")
    return "\n".join(lines)


__all__ = ["ITEMS", "format_report"]
