"""Running several ranks on ONE GPU: spawned processes joined in a gloo group, each on ``cuda:0`` with
``EP_MOE_SYMMETRIC_MEMORY=vmm``, so that the native backend's symmetric memory is every rank's device allocation
mapped into every rank's process (`ep_moe.native.symmetric.VmmSymmetricBuffer`). The ranks' kernels share the GPU
by time slicing (no MPS): every wait on a peer may cost a scheduler time slice, so tests keep shapes small.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ep_moe import native
from ep_moe.distributed import run_distributed
from ep_moe.memory.cuda_vmm import vmm_unavailable_reason
from ep_moe.native.symmetric import SYMMETRIC_MEMORY_ENV

DEVICE = torch.device("cuda", 0)


def skip_unless_shared_gpu_runs() -> None:
    """Skip (with the reason) where ranks cannot share GPU 0 through VMM memory with the native kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not native.extension_available():
        pytest.skip(f"the native CUDA extension is unavailable ({native.extension_unavailable_reason()})")
    reason = vmm_unavailable_reason(DEVICE, exportable=True, host=False)
    if reason is not None:
        pytest.skip(f"VMM device memory cannot be shared between processes here: {reason}")


def _on_shared_gpu(rank: int, world: int, fn: Callable, *args: Any) -> Any:
    os.environ[SYMMETRIC_MEMORY_ENV] = "vmm"  # before any Buffer: the native backend then maps VMM memory
    torch.cuda.set_device(DEVICE)
    return fn(rank, world, *args)


def run_on_one_gpu(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0,
                   join_timeout_s: float = 600.0) -> list[Any]:
    """``fn(rank, world, *args)`` at ``world`` spawned ranks, all on GPU 0, in one gloo group, with
    ``EP_MOE_SYMMETRIC_MEMORY=vmm``; every rank's return value, by rank (`ep_moe.distributed.run_distributed`:
    ``timeout_s`` bounds each gloo collective, ``join_timeout_s`` the run). ``fn`` must be importable."""
    return run_distributed(_on_shared_gpu, world, fn, *args, backend="gloo", timeout_s=timeout_s,
                           join_timeout_s=join_timeout_s)
