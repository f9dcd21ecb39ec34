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
import torch.distributed as dist

from ep_moe import native
from ep_moe.distributed import run_distributed
from ep_moe.elastic.memory.cuda_vmm import vmm_unavailable_reason
from ep_moe.native.symmetric import SYMMETRIC_MEMORY_ENV

DEVICE = torch.device("cuda", 0)


def skip_unless_shared_gpu_runs() -> None:
    """Skip (with the reason) where ranks cannot share GPU 0 through VMM memory with the native kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not native.kernels_available():
        pytest.skip(f"no native kernels can run here ({native.kernels_unavailable_reason()})")
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


def check_symmetric_buffer(buf, rank: int, world: int) -> None:
    """Collective over the world group: every rank fills its copy of ``buf`` (a `SymmetricBuffer`) with its own
    pattern; every rank then reads every copy through ``peer_tensor`` (at ``ptrs``), writes its rank into slot
    ``rank`` (1 KiB) of every copy, and finds every rank's write in its own copy."""
    device = buf.tensor.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def pattern(owner: int) -> torch.Tensor:
        return ((torch.arange(buf.nbytes, device=device) * 7 + 13 * owner + 1) % 251).to(torch.uint8)

    assert len(buf.ptrs) == world and buf.tensor.numel() == buf.nbytes and buf.tensor.data_ptr() == buf.ptrs[rank]
    buf.tensor.copy_(pattern(rank))
    sync()
    dist.barrier()
    for owner in range(world):
        peer = buf.peer_tensor(owner)
        assert peer.data_ptr() == buf.ptrs[owner] and peer.device == device and peer.numel() == buf.nbytes
        assert torch.equal(peer, pattern(owner)), f"rank {rank} reads rank {owner}'s copy wrong"
    dist.barrier()
    for owner in range(world):
        buf.peer_tensor(owner)[rank * 1024:(rank + 1) * 1024].fill_(100 + rank)
    sync()
    dist.barrier()
    for writer in range(world):
        got = buf.tensor[writer * 1024:(writer + 1) * 1024]
        assert bool((got == 100 + writer).all()), f"rank {writer}'s write did not reach rank {rank}"
    with pytest.raises(ValueError, match="'rank'"):
        buf.peer_tensor(world)
    dist.barrier()
