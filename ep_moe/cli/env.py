"""``ep-moe env``: what this installation runs on, and whether the native kernels can run, and why not.

Prints one ``name: value`` line per item: ep_moe's version and location, what ``python -m ep_moe.native``
reports (`ep_moe.native.report`: interpreter, torch, CUDA and the GPUs, NCCL, symmetric memory, the JIT
kernels, their compiler and cache, the multicast variables), the implementation of the expert-major kernels (jit
or torch, and why torch), and the calibration cache. An item that cannot be found out says why instead; the exit
status is 0 whenever the report is printed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import ep_moe

from ..native import report as native_report
from ..tuning.calibration import cache_path


def _expert_major_kernels() -> str:
    """The implementation `ep_moe.permute` picks for bf16 CUDA tensors here, and why when it is torch code."""
    from .. import permute

    if not torch.cuda.is_available():
        return "torch (no CUDA device)"
    probe = torch.empty(0, dtype=torch.bfloat16, device=torch.device("cuda", torch.cuda.current_device()))
    how = permute.kernel_implementation(probe)
    return how if how != "torch" else f"torch ({permute.torch_fallback_reason(probe)})"


def _calibration_cache() -> str:
    path = cache_path()
    return f"{path} ({'exists' if path.exists() else 'not written yet'})"


ITEMS: tuple[native_report.Item, ...] = (
    ("ep_moe", lambda: f"{ep_moe.__version__} from {Path(ep_moe.__file__).parent}"),
    *native_report.ITEMS,
    ("permute kernels", _expert_major_kernels),
    ("calibration cache", _calibration_cache),
)


def report() -> str:
    """The report's text (see the module docstring)."""
    return native_report.format_report(ITEMS)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="ep-moe env", description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(report(), flush=True)
    return 0


__all__ = ["ITEMS", "main", "report"]
